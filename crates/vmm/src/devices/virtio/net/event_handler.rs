//! How the network device reacts to events on the device thread.
//!
//! The tap is polled only while the guest can take frames: when a frame
//! is read and no rx buffer is available, the tap leaves the event manager
//! and the frame waits; the guest's next rx notification delivers it and
//! puts the tap back. No busy loop, and the kernel's tap queue (like a
//! NIC's ring) holds what arrives meanwhile.

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};

use super::device::Rx;
use super::Net;
use crate::devices::virtio::device_common::ACTIVATE_EVENT;

const RX_QUEUE: u32 = 1;
const TX_QUEUE: u32 = 2;
const TAP: u32 = 3;

impl Net {
    fn tap_events(&self) -> Events {
        Events::with_data(&self.tap, TAP, EventSet::IN)
    }

    fn set_tap_polled(&mut self, ops: &mut EventOps, polled: bool) {
        if polled == self.tap_registered || (polled && self.tap_failed) {
            return;
        }
        let res = if polled {
            ops.add(self.tap_events())
        } else {
            ops.remove(self.tap_events())
        };
        match res {
            Ok(()) => self.tap_registered = polled,
            Err(e) => tracing::error!("virtio-net: cannot (un)register tap: {e}"),
        }
    }

    fn rx(&mut self, ops: &mut EventOps) {
        let polled = self.process_rx() == Rx::TapDrained;
        self.set_tap_polled(ops, polled);
    }
}

impl MutEventSubscriber for Net {
    fn init(&mut self, ops: &mut EventOps) {
        self.base.register_activation(ops);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            ACTIVATE_EVENT => {
                let queue_evts = [(0, RX_QUEUE), (1, TX_QUEUE)]
                    .into_iter()
                    .filter_map(|(index, data)| Some((self.queue_evt(index)?, data)));
                self.base.on_activate(ops, queue_evts);
                self.set_tap_polled(ops, true);
                self.process_tx();
                self.rx(ops);
            }
            RX_QUEUE => {
                if let Some(evt) = self.queue_evt(0) {
                    let _ = evt.read();
                }
                if self.rx_pending() || !self.tap_registered {
                    self.rx(ops);
                }
            }
            TX_QUEUE => {
                if let Some(evt) = self.queue_evt(1) {
                    let _ = evt.read();
                }
                self.process_tx();
            }
            TAP => {
                if events
                    .event_set()
                    .intersects(EventSet::ERROR | EventSet::HANG_UP)
                {
                    tracing::error!("virtio-net: tap {} failed; no more rx", self.tap.name());
                    self.set_tap_polled(ops, false);
                    self.tap_failed = true;
                    return;
                }
                self.rx(ops);
            }
            other => tracing::warn!("virtio-net: unexpected event {other}"),
        }
    }
}

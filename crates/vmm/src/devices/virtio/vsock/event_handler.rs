//! How the vsock device reacts to events on the device thread.
//!
//! At init it subscribes its activate `EventFd` and the host listening
//! socket; on activation it subscribes the three queue `EventFd`s;
//! connection sockets come and go as the muxer needs them.

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use tracing::warn;

use super::device::{Vsock, EVQ, RXQ, TXQ};
use super::unix::EVENT_CONN;
use crate::devices::virtio::device_common::ACTIVATE_EVENT;

const EVENT_RXQ: u32 = 1;
const EVENT_TXQ: u32 = 2;
const EVENT_EVQ: u32 = 3;
const EVENT_LISTENER: u32 = 4;

impl Vsock {
    fn register_queue_evts(&mut self, ops: &mut EventOps) {
        if self.queue_evts_registered {
            return;
        }
        let Some(active) = &self.active else {
            return;
        };
        for (index, data) in [(RXQ, EVENT_RXQ), (TXQ, EVENT_TXQ), (EVQ, EVENT_EVQ)] {
            if let Err(e) = ops.add(Events::with_data(
                &active.queue_evts[index],
                data,
                EventSet::IN,
            )) {
                warn!("vsock: cannot poll queue {index}: {e:?}");
            }
        }
        self.queue_evts_registered = true;
    }

    fn drain_queue_evt(&self, index: usize) {
        if let Some(active) = &self.active {
            // A failed read means nothing was pending; the queue is served anyway.
            let _ = active.queue_evts[index].read();
        }
    }
}

impl MutEventSubscriber for Vsock {
    fn init(&mut self, ops: &mut EventOps) {
        self.base.register_activation(ops);
        if let Err(e) = ops.add(Events::with_data(
            self.muxer.listener(),
            EVENT_LISTENER,
            EventSet::IN,
        )) {
            warn!("vsock: cannot poll the host socket: {e:?}");
        }
        if self.active.is_some() {
            self.register_queue_evts(ops);
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            ACTIVATE_EVENT => {
                // Queue events go through `register_queue_evts`: `init` may
                // have added them already (a device subscribed after activation).
                self.base.on_activate(ops, []);
                self.register_queue_evts(ops);
                self.send_transport_reset();
                self.run_queues(ops, true);
            }
            EVENT_RXQ => {
                self.drain_queue_evt(RXQ);
                self.run_queues(ops, false);
            }
            EVENT_TXQ => {
                self.drain_queue_evt(TXQ);
                self.run_queues(ops, true);
            }
            EVENT_EVQ => {
                self.drain_queue_evt(EVQ);
                self.send_transport_reset();
                if self.check_reset_handled() {
                    self.run_queues(ops, false);
                }
            }
            EVENT_LISTENER => {
                self.muxer.handle_listener(ops);
                self.run_queues(ops, false);
            }
            EVENT_CONN => {
                if let Some(u) = self
                    .muxer
                    .handle_fd_event(events.fd(), events.event_set(), ops)
                {
                    self.report_unanswered(&u);
                }
                self.run_queues(ops, false);
            }
            other => warn!("vsock: unexpected event {other}"),
        }
    }
}

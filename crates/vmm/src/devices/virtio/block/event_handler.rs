//! How the block device reacts to events on the device thread.

use event_manager::{EventOps, Events, MutEventSubscriber};

use super::Block;
use crate::devices::virtio::device_common::ACTIVATE_EVENT;

const QUEUE: u32 = 1;

impl MutEventSubscriber for Block {
    fn init(&mut self, ops: &mut EventOps) {
        self.base.register_activation(ops);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            ACTIVATE_EVENT => {
                let queue_evt = self.queue_evt().map(|evt| (evt, QUEUE));
                self.base.on_activate(ops, queue_evt);
                // Requests the driver queued before we were listening.
                self.process_queue();
            }
            QUEUE => {
                if let Some(evt) = self.queue_evt() {
                    let _ = evt.read();
                }
                self.process_queue();
            }
            other => tracing::warn!("virtio-blk: unexpected event {other}"),
        }
    }
}

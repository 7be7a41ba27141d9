//! How the block device reacts to events on the device thread.

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};

use super::Block;

const ACTIVATE: u32 = 0;
const QUEUE: u32 = 1;

impl MutEventSubscriber for Block {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::with_data(
            &self.activate_evt,
            ACTIVATE,
            EventSet::IN,
        )) {
            tracing::error!("virtio-blk: cannot register activation event: {e}");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            ACTIVATE => {
                let _ = self.activate_evt.read();
                if let Err(e) = ops.remove(Events::with_data(
                    &self.activate_evt,
                    ACTIVATE,
                    EventSet::IN,
                )) {
                    tracing::error!("virtio-blk: cannot unregister activation event: {e}");
                }
                if let Some(evt) = self.queue_evt() {
                    if let Err(e) = ops.add(Events::with_data(evt, QUEUE, EventSet::IN)) {
                        tracing::error!("virtio-blk: cannot register queue event: {e}");
                    }
                }
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

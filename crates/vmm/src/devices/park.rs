//! Parking the device thread: the fork path's step 1 for devices.
//!
//! The device thread serves queue notifications, tap frames and vsock
//! sockets. While the vm is frozen nothing may write guest memory, so the
//! controller asks the thread to park: a subscriber on its event loop
//! answers "parked" and blocks until told to go on. Events that arrive
//! meanwhile wait in their fds and are served after the resume (or by the
//! restored devices of a child). Every device handler runs to completion
//! before the next event, so a parked thread holds no request half done.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// How long the device thread may take to park (it normally takes µs;
/// a device handler stuck on a slow disk is the only reason to wait).
const PARK_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors while parking the device thread.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    #[error("Cannot wake the device thread")]
    Wake(#[source] std::io::Error),
    #[error("The device thread did not park within {PARK_TIMEOUT:?}")]
    Timeout,
    #[error("The device thread has stopped")]
    Gone,
}

/// The subscriber that parks the device thread (lives in its event loop).
pub struct DeviceParker {
    evt: EventFd,
    parked: Sender<()>,
    resume: Receiver<()>,
}

/// The controller's side.
pub struct ParkControl {
    evt: EventFd,
    parked: Receiver<()>,
    resume: Sender<()>,
    is_parked: bool,
}

/// A parker for the event loop and its control.
pub fn device_park() -> std::io::Result<(DeviceParker, ParkControl)> {
    let evt = EventFd::new(EFD_NONBLOCK)?;
    let (parked_tx, parked_rx) = mpsc::channel();
    let (resume_tx, resume_rx) = mpsc::channel();
    Ok((
        DeviceParker {
            evt: evt.try_clone()?,
            parked: parked_tx,
            resume: resume_rx,
        },
        ParkControl {
            evt,
            parked: parked_rx,
            resume: resume_tx,
            is_parked: false,
        },
    ))
}

impl ParkControl {
    /// Returns once the device thread is parked.
    pub fn park(&mut self) -> Result<(), ParkError> {
        if self.is_parked {
            return Ok(());
        }
        self.evt.write(1).map_err(ParkError::Wake)?;
        match self.parked.recv_timeout(PARK_TIMEOUT) {
            Ok(()) => {
                self.is_parked = true;
                Ok(())
            }
            Err(RecvTimeoutError::Timeout) => Err(ParkError::Timeout),
            Err(RecvTimeoutError::Disconnected) => Err(ParkError::Gone),
        }
    }

    /// Lets a parked device thread go on.
    pub fn unpark(&mut self) {
        if self.is_parked {
            // A gone thread has nothing to resume.
            let _ = self.resume.send(());
            self.is_parked = false;
        }
    }
}

impl MutEventSubscriber for DeviceParker {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.evt, EventSet::IN)) {
            tracing::error!("cannot register the device park event: {e:?}");
        }
    }

    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        // Nothing to read means a spurious wake-up; park anyway, the
        // controller is waiting.
        let _ = self.evt.read();
        if self.parked.send(()).is_ok() {
            // Blocks the device thread until resumed; a dropped control
            // (the process is ending) lets it go.
            let _ = self.resume.recv();
        }
    }
}

//! COM1: an 8250 UART (vm-superio) whose output goes to the vm's console
//! log (and optionally the VMM's stdout) and whose input comes from the host.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::BusDevice;

/// I/O port base of COM1.
pub const COM1_PORT: u64 = 0x3f8;
/// COM1 occupies eight ports.
pub const COM1_LEN: u64 = 8;

/// Raises the UART's interrupt line through a KVM irqfd.
#[derive(Debug)]
pub struct IrqFdTrigger(pub EventFd);

impl Trigger for IrqFdTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// Where guest console output goes.
#[derive(Debug, Default)]
pub struct ConsoleOutput {
    log: Option<ConsoleLog>,
    stdout: bool,
}

/// The console log file: the guest writes it, so it is capped. At
/// [`ConsoleLog::CAP`] bytes its content moves to `NAME.1` (replacing the
/// previous one) and it starts again empty, so a vm's console costs at
/// most twice the cap on disk however much the guest prints. Both files
/// are opened when the vm starts: serial output is written on the vCPU
/// thread, whose seccomp filter allows no open or rename, only ftruncate
/// and pread.
#[derive(Debug)]
struct ConsoleLog {
    file: File,
    /// `NAME.1` (None: a file given without a path; capped by dropping
    /// what is past the cap).
    old: Option<File>,
    size: u64,
}

impl ConsoleLog {
    const CAP: u64 = 256 << 10;

    fn write(&mut self, buf: &[u8]) {
        if self.size + buf.len() as u64 > Self::CAP {
            let Some(old) = &mut self.old else { return };
            if Self::rotate(&self.file, old, self.size).is_err() {
                // The cap holds: nothing more is written.
                return;
            }
            self.size = 0;
        }
        if self.file.write_all(buf).is_ok() {
            self.size += buf.len() as u64;
        }
    }

    /// Copies `len` bytes of `file` into `old` (emptied first), then
    /// empties `file` (opened for appending: the next write is at 0).
    fn rotate(file: &File, old: &mut File, len: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        old.set_len(0)?;
        let mut buf = vec![0u8; 64 << 10];
        let mut at = 0u64;
        while at < len {
            let n = file.read_at(&mut buf, at)?;
            if n == 0 {
                break;
            }
            old.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
        file.set_len(0)
    }
}

impl ConsoleOutput {
    /// Output to an optional log file and, if `stdout`, the VMM's stdout.
    pub fn new(log: Option<File>, stdout: bool) -> Self {
        let log = log.map(|file| ConsoleLog {
            size: file.metadata().map(|m| m.len()).unwrap_or(0),
            file,
            old: None,
        });
        Self { log, stdout }
    }

    /// Output to the log file at `path` (appended to; rotated at the cap)
    /// and, if `stdout`, the VMM's stdout.
    pub fn with_log_path(path: &Path, stdout: bool) -> io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(path)?;
        let mut name = path.as_os_str().to_owned();
        name.push(".1");
        let old = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(PathBuf::from(name))?;
        Ok(Self {
            log: Some(ConsoleLog {
                size: file.metadata()?.len(),
                file,
                old: Some(old),
            }),
            stdout,
        })
    }
}

impl Write for ConsoleOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // Console output is best effort: a full disk or closed stdout must not
        // stop the guest, so errors are dropped here.
        if let Some(log) = self.log.as_mut() {
            log.write(buf);
        }
        if self.stdout {
            let mut out = io::stdout().lock();
            let _ = out.write_all(buf);
            let _ = out.flush();
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The serial port as a bus device.
pub struct SerialDevice {
    serial: Serial<IrqFdTrigger, NoEvents, ConsoleOutput>,
}

impl SerialDevice {
    /// A UART raising `irq` and writing to `out`.
    pub fn new(irq: EventFd, out: ConsoleOutput) -> Self {
        Self {
            serial: Serial::new(IrqFdTrigger(irq), out),
        }
    }

    /// Queues host input for the guest; returns how many bytes fit in the FIFO.
    pub fn enqueue_input(&mut self, input: &[u8]) -> usize {
        if self.serial.fifo_capacity() == 0 {
            return 0;
        }
        self.serial.enqueue_raw_bytes(input).unwrap_or(0)
    }

    /// The device state (registers and pending input).
    pub fn state(&self) -> SerialState {
        SerialState::from(&self.serial.state())
    }

    /// Rebuilds the UART from a saved state.
    pub fn from_state(
        state: &SerialState,
        irq: EventFd,
        out: ConsoleOutput,
    ) -> Result<Self, SerialError> {
        let serial = Serial::from_state(&state.into(), IrqFdTrigger(irq), NoEvents, out)
            .map_err(|_| SerialError::BadState)?;
        Ok(Self { serial })
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && offset < COM1_LEN {
            data[0] = self.serial.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 && offset < COM1_LEN {
            if let Err(e) = self.serial.write(offset as u8, data[0]) {
                tracing::warn!("serial write failed: {e:?}");
            }
        }
    }
}

/// Errors restoring the serial port.
#[derive(Debug, thiserror::Error)]
pub enum SerialError {
    /// The saved input buffer is larger than the UART's FIFO.
    #[error("Saved serial state is invalid (input buffer larger than the FIFO)")]
    BadState,
}

/// Saved UART registers, as plain serde data.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerialState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl From<&vm_superio::SerialState> for SerialState {
    fn from(s: &vm_superio::SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

impl From<&SerialState> for vm_superio::SerialState {
    fn from(s: &SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evt() -> EventFd {
        EventFd::new(libc::EFD_NONBLOCK).expect("eventfd")
    }

    #[test]
    fn test_serial_state_save_restore_save_equal() {
        let mut dev = SerialDevice::new(evt(), ConsoleOutput::default());
        dev.write(3, &[0x80]); // DLAB on
        dev.write(0, &[0x0c]); // divisor low
        dev.write(3, &[0x03]); // 8N1, DLAB off
        dev.write(1, &[0x01]); // IER: data ready
        dev.write(7, &[0x5a]); // scratch
        assert_eq!(dev.enqueue_input(b"abc"), 3);
        let first = dev.state();
        let json = serde_json::to_string(&first).expect("serialize");
        let back: SerialState = serde_json::from_str(&json).expect("deserialize");
        let restored =
            SerialDevice::from_state(&back, evt(), ConsoleOutput::default()).expect("restore");
        assert_eq!(restored.state(), first);
        assert_eq!(first.in_buffer, b"abc");
        assert_eq!(first.scratch, 0x5a);
    }

    #[test]
    fn test_serial_restore_rejects_oversized_fifo() {
        let state = SerialState {
            in_buffer: vec![0; 1 << 16],
            ..SerialDevice::new(evt(), ConsoleOutput::default()).state()
        };
        assert!(SerialDevice::from_state(&state, evt(), ConsoleOutput::default()).is_err());
    }

    #[test]
    fn test_console_log_is_capped_and_rotated() {
        let dir = std::env::temp_dir().join(format!("tine-console-cap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("console.log");
        let mut out = ConsoleOutput::with_log_path(&path, false).expect("open");
        let line = [b'x'; 100];
        for _ in 0..(4 * ConsoleLog::CAP / 100) {
            out.write_all(&line).expect("write");
        }
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        let old = dir.join("console.log.1");
        assert!(size(&path) <= ConsoleLog::CAP, "{}", size(&path));
        assert!(
            size(&old) <= ConsoleLog::CAP && size(&old) > 0,
            "{}",
            size(&old)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

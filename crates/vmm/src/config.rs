//! What the user asks for: one vm's configuration, validated before any KVM call.

use std::path::PathBuf;

/// Smallest guest RAM we boot.
pub const MIN_MEM_MIB: u64 = 64;
/// Largest guest RAM we boot.
pub const MAX_MEM_MIB: u64 = 16 * 1024;
/// Most vCPUs per vm.
pub const MAX_VCPUS: u8 = 4;

/// A raw disk image attached as virtio-blk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub read_only: bool,
}

/// A tap device attached as virtio-net.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    pub tap: String,
    pub mac: [u8; 6],
    /// An already attached fd of `tap` to use instead of opening it (the
    /// continuation of a fork inherits its parent's: a tap has one reader).
    pub tap_fd: Option<i32>,
}

/// A virtio-vsock device with a host Unix socket (Firecracker's hybrid convention).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VsockConfig {
    pub guest_cid: u64,
    pub uds_path: PathBuf,
}

/// One vm.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Uncompressed ELF vmlinux, micro guest, or bzImage.
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    /// Kernel command line; the VMM appends nothing the user did not ask for
    /// beyond what its devices need.
    pub cmdline: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    /// Console log file (8250 COM1 output).
    pub console_log: Option<PathBuf>,
    /// Also copy console output to stdout.
    pub console_stdout: bool,
    /// Feed stdin to the console.
    pub console_stdin: bool,
    /// A Unix socket whose connections' bytes are fed to the console
    /// (`tine console NAME --send`), for a vm without a terminal.
    pub console_socket: Option<PathBuf>,
    pub disks: Vec<DiskConfig>,
    pub nets: Vec<NetConfig>,
    pub vsock: Option<VsockConfig>,
    /// The KVM device (normally /dev/kvm).
    pub kvm_device: PathBuf,
    /// The CPU template the guest's CPUID (and MSRs) are normalized to at
    /// boot (docs/design/cpu-templates.md). A restored vm keeps its
    /// snapshot's (its vCPUs' CPUID is saved state); it is set here so
    /// that its next snapshot records it too.
    pub cpu_template: Option<snapshot::template::Template>,
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            kernel: PathBuf::new(),
            initrd: None,
            cmdline: String::new(),
            mem_mib: 256,
            vcpus: 1,
            console_log: None,
            console_stdout: false,
            console_stdin: false,
            console_socket: None,
            disks: Vec::new(),
            nets: Vec::new(),
            vsock: None,
            kvm_device: PathBuf::from("/dev/kvm"),
            cpu_template: None,
        }
    }
}

/// A configuration the VMM refuses before touching KVM.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("Guest memory {0} MiB is below the minimum of {MIN_MEM_MIB} MiB; use --mem {MIN_MEM_MIB}M or more")]
    MemTooSmall(u64),
    #[error("Guest memory {0} MiB is above the maximum of {MAX_MEM_MIB} MiB")]
    MemTooLarge(u64),
    #[error("Guest memory {want} MiB is more than this host has ({host} MiB total); use a smaller --mem")]
    MemAboveHost { want: u64, host: u64 },
    #[error("{0} vCPUs requested; tine runs 1 to {MAX_VCPUS}")]
    VcpuCount(u8),
    #[error("Kernel {0} not found; pass an existing vmlinux, bzImage or micro guest")]
    KernelMissing(PathBuf),
    #[error("Initramfs {0} not found")]
    InitrdMissing(PathBuf),
    #[error(
        "Disk image {0} not found; create it first (e.g. truncate -s 1G FILE) or fix the path"
    )]
    DiskMissing(PathBuf),
    #[error("Too many virtio devices ({0}); at most 16")]
    TooManyDevices(usize),
}

impl VmConfig {
    /// Checks everything that can be checked without KVM.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_for_host(host_mem_mib())
    }

    /// [`VmConfig::validate`] against a host with `host_mib` of RAM.
    pub fn validate_for_host(&self, host_mib: Option<u64>) -> Result<(), ConfigError> {
        if self.mem_mib < MIN_MEM_MIB {
            return Err(ConfigError::MemTooSmall(self.mem_mib));
        }
        if self.mem_mib > MAX_MEM_MIB {
            return Err(ConfigError::MemTooLarge(self.mem_mib));
        }
        if let Some(host) = host_mib {
            if self.mem_mib > host {
                return Err(ConfigError::MemAboveHost {
                    want: self.mem_mib,
                    host,
                });
            }
        }
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(ConfigError::VcpuCount(self.vcpus));
        }
        if !self.kernel.is_file() {
            return Err(ConfigError::KernelMissing(self.kernel.clone()));
        }
        if let Some(initrd) = &self.initrd {
            if !initrd.is_file() {
                return Err(ConfigError::InitrdMissing(initrd.clone()));
            }
        }
        for d in &self.disks {
            if !d.path.exists() {
                return Err(ConfigError::DiskMissing(d.path.clone()));
            }
        }
        let n = self.disks.len() + self.nets.len() + usize::from(self.vsock.is_some());
        if n > 16 {
            return Err(ConfigError::TooManyDevices(n));
        }
        Ok(())
    }
}

/// Total host memory (sysinfo(2), not /proc: a jailed VMM has no /proc).
fn host_mem_mib() -> Option<u64> {
    let info = nix::sys::sysinfo::sysinfo().ok()?;
    Some(info.ram_total() >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> VmConfig {
        VmConfig {
            kernel: PathBuf::from("/proc/self/exe"),
            ..Default::default()
        }
    }

    #[test]
    fn test_validate_memory_bounds() {
        assert_eq!(
            VmConfig {
                mem_mib: 32,
                ..cfg()
            }
            .validate(),
            Err(ConfigError::MemTooSmall(32))
        );
        assert_eq!(
            VmConfig {
                mem_mib: 32768,
                ..cfg()
            }
            .validate(),
            Err(ConfigError::MemTooLarge(32768))
        );
        assert!(cfg().validate().is_ok());
        assert_eq!(
            VmConfig {
                mem_mib: 8192,
                ..cfg()
            }
            .validate_for_host(Some(4096)),
            Err(ConfigError::MemAboveHost {
                want: 8192,
                host: 4096
            })
        );
    }

    #[test]
    fn test_validate_vcpus_and_files() {
        assert_eq!(
            VmConfig { vcpus: 5, ..cfg() }.validate(),
            Err(ConfigError::VcpuCount(5))
        );
        assert_eq!(
            VmConfig { vcpus: 0, ..cfg() }.validate(),
            Err(ConfigError::VcpuCount(0))
        );
        let missing = PathBuf::from("/nonexistent/kernel");
        assert_eq!(
            VmConfig {
                kernel: missing.clone(),
                ..cfg()
            }
            .validate(),
            Err(ConfigError::KernelMissing(missing))
        );
        let disk = DiskConfig {
            path: PathBuf::from("/nonexistent/disk.raw"),
            read_only: false,
        };
        assert!(matches!(
            VmConfig {
                disks: vec![disk],
                ..cfg()
            }
            .validate(),
            Err(ConfigError::DiskMissing(_))
        ));
    }
}

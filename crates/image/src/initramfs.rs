//! The initramfs: a newc cpio archive (uncompressed: the kernel unpacks it
//! without a decompression step) with busybox, the virtio modules and /init.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use cpio::newc::{trailer, Builder};

use crate::modules::Module;
use crate::ImageError;

/// Where the module load order is kept inside the initramfs.
pub const MODULE_ORDER_PATH: &str = "etc/tine/modules";

/// Printed on the console once the guest is up (modules loaded, lo up).
pub const READY_MARKER: &str = "tine: guest ready";

/// The sed program /init uses to take `tine.init=CMD` or `tine.init="CMD"`
/// from /proc/cmdline.
pub const CMDLINE_INIT_SED: &str =
    r#"sed -n -e 's/.*tine\.init="\([^"]*\)".*/\1/p' -e t -e 's/.*tine\.init=\([^ ]*\).*/\1/p'"#;

/// The guest's /init (busybox sh).
pub fn init_script() -> String {
    format!(
        r#"#!/bin/busybox sh
# tine minimal guest: mount, load the virtio modules, say ready, then run
# the console shell (again whenever it ends), or the command given as
# tine.init=... and power off.
# When the image has the guest agent, it runs in the background, logging
# to the console.
/bin/busybox --install -s
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=linux
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
for m in $(cat /{order}); do
    insmod "/lib/modules/$m.ko" || echo "tine: cannot load module $m"
done
ip link set lo up
hostname tine
if [ -x /bin/tine-agent ]; then
    setsid /bin/tine-agent serve </dev/null >/dev/console 2>&1 &
fi
cmd=$({sed} /proc/cmdline)
echo "{ready}"
if [ -n "$cmd" ]; then
    sh -c "$cmd"
    echo "tine: exit $?"
else
    # The console shell is respawned, as a getty is: it ending (an EOF or
    # hangup on the console) must not power off a vm whose agent serves.
    # `poweroff -f` powers it off.
    while :; do
        setsid cttyhack sh
        echo "tine: the console shell ended (status $?); starting another"
        sleep 1
    done
fi
sync
poweroff -f
"#,
        order = MODULE_ORDER_PATH,
        sed = CMDLINE_INIT_SED,
        ready = READY_MARKER,
    )
}

const DIRS: &[&str] = &[
    "bin",
    "dev",
    "etc",
    "etc/tine",
    "lib",
    "lib/modules",
    "mnt",
    "proc",
    "root",
    "run",
    "sbin",
    "sys",
    "tmp",
    "usr",
    "usr/bin",
    "usr/sbin",
];

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

struct Archive<W: Write> {
    out: W,
    ino: u32,
}

impl<W: Write> Archive<W> {
    fn entry(&mut self, name: &str, mode: u32) -> Builder {
        self.ino += 1;
        Builder::new(name).ino(self.ino).mode(mode).nlink(1)
    }

    fn dir(&mut self, name: &str) -> std::io::Result<()> {
        let perm = match name {
            "root" => 0o700,
            "tmp" => 0o1777,
            _ => 0o755,
        };
        let b = self.entry(name, S_IFDIR | perm).nlink(2);
        b.write(&mut self.out, 0).finish()?;
        Ok(())
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) -> std::io::Result<()> {
        let size = u32::try_from(data.len())
            .map_err(|_| std::io::Error::other(format!("{name} is larger than 4 GiB")))?;
        let mut w = self.entry(name, S_IFREG | perm).write(&mut self.out, size);
        w.write_all(data)?;
        w.finish()?;
        Ok(())
    }

    fn char_dev(&mut self, name: &str, perm: u32, major: u32, minor: u32) -> std::io::Result<()> {
        let b = self
            .entry(name, S_IFCHR | perm)
            .rdev_major(major)
            .rdev_minor(minor);
        b.write(&mut self.out, 0).finish()?;
        Ok(())
    }
}

/// Writes the initramfs to `dest`: directories, /dev/console, busybox,
/// the modules (as /lib/modules/<name>.ko, in load order) and /init.
pub fn write(
    dest: &Path,
    busybox: &[u8],
    modules: &[Module],
    init: &str,
    agent: Option<&[u8]>,
) -> Result<(), ImageError> {
    let file = File::create(dest).map_err(|e| ImageError::io(dest, e))?;
    let mut ar = Archive {
        out: BufWriter::new(file),
        ino: 0,
    };
    let result = (|| -> Result<(), ImageError> {
        let io = |e| ImageError::io(dest, e);
        for d in DIRS {
            ar.dir(d).map_err(io)?;
        }
        // The kernel opens /dev/console for init before devtmpfs is mounted.
        ar.char_dev("dev/console", 0o600, 5, 1).map_err(io)?;
        ar.file("bin/busybox", 0o755, busybox).map_err(io)?;
        if let Some(agent) = agent {
            ar.file("bin/tine-agent", 0o755, agent).map_err(io)?;
        }
        let mut order = String::new();
        for m in modules {
            let bytes = std::fs::read(&m.path).map_err(|e| ImageError::io(&m.path, e))?;
            ar.file(&format!("lib/modules/{}.ko", m.name), 0o644, &bytes)
                .map_err(io)?;
            order.push_str(&m.name);
            order.push('\n');
        }
        ar.file(MODULE_ORDER_PATH, 0o644, order.as_bytes())
            .map_err(io)?;
        ar.file("init", 0o755, init.as_bytes()).map_err(io)?;
        trailer(&mut ar.out).map_err(io)?;
        ar.out.flush().map_err(io)?;
        ar.out.get_ref().sync_all().map_err(io)
    })();
    if result.is_err() {
        std::fs::remove_file(dest).ok();
    }
    result
}

/// Names and sizes of the entries of a newc archive (for checks and tests).
pub fn list(archive: &Path) -> Result<Vec<(String, u32)>, ImageError> {
    let mut f =
        std::io::BufReader::new(File::open(archive).map_err(|e| ImageError::io(archive, e))?);
    let mut names = Vec::new();
    loop {
        let r = cpio::NewcReader::new(f).map_err(|e| ImageError::io(archive, e))?;
        if r.entry().is_trailer() {
            return Ok(names);
        }
        names.push((r.entry().name().to_string(), r.entry().file_size()));
        f = r.finish().map_err(|e| ImageError::io(archive, e))?;
    }
}

/// The contents of one file in a newc archive.
pub fn read_file(archive: &Path, name: &str) -> Result<Option<Vec<u8>>, ImageError> {
    use std::io::Read;
    let mut f =
        std::io::BufReader::new(File::open(archive).map_err(|e| ImageError::io(archive, e))?);
    loop {
        let mut r = cpio::NewcReader::new(f).map_err(|e| ImageError::io(archive, e))?;
        if r.entry().is_trailer() {
            return Ok(None);
        }
        if r.entry().name() == name {
            let mut data = Vec::new();
            r.read_to_end(&mut data)
                .map_err(|e| ImageError::io(archive, e))?;
            return Ok(Some(data));
        }
        f = r.finish().map_err(|e| ImageError::io(archive, e))?;
    }
}

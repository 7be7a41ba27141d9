//! The virtio-blk device: configuration, features and queue servicing.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO,
    VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_ID_BYTES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::request::{self, Disk};
use super::{QUEUE_SIZE, SECTOR_SIZE};
use crate::devices::virtio::device_common::{signal_used, ActiveQueues, DeviceBase};
use crate::devices::virtio::queue::ChainBuffers;
use crate::devices::virtio::{ActivateError, Interrupt, VirtioDevice, VirtioDeviceState};
use crate::memory::GuestMemoryMmap;

/// How to build a [`Block`] device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockConfig {
    /// Raw disk image on the host.
    pub path: PathBuf,
    /// Offer the disk read-only (the file is then opened read-only).
    pub read_only: bool,
    /// Serial the guest reads with GET_ID (at most 20 bytes); defaults to
    /// the image's file name, truncated.
    pub id: Option<String>,
}

/// Errors while creating a block device.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// Creating the activation eventfd failed.
    #[error("Cannot create an eventfd for the block device")]
    EventFd(#[source] io::Error),
    /// The id does not fit the 20-byte GET_ID answer.
    #[error("Block device id {0:?} is longer than 20 bytes")]
    IdTooLong(String),
    /// The image (or a layer of its backing chain) cannot be opened.
    #[error("Cannot open disk image")]
    Open(#[from] disk::DiskError),
}

/// A virtio-blk device backed by a disk image: raw, or a qcow2 chain.
pub struct Block {
    config: BlockConfig,
    disk: Disk,
    pub(super) base: DeviceBase,
    active: Option<ActiveQueues<1>>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("config", &self.config)
            .field("activated", &self.active.is_some())
            .finish()
    }
}

impl Block {
    /// Opens the image (read-write unless `read_only`).
    pub fn new(config: BlockConfig) -> Result<Self, BlockError> {
        let id = match &config.id {
            Some(id) if id.len() > VIRTIO_BLK_ID_BYTES as usize => {
                return Err(BlockError::IdTooLong(id.clone()))
            }
            Some(id) => id.clone(),
            None => config
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        };
        let mut id_bytes = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let n = id.len().min(id_bytes.len());
        id_bytes[..n].copy_from_slice(&id.as_bytes()[..n]);

        // The top layer is opened writable unless read_only; every layer
        // below it is read-only and never written (crates/disk).
        let image = disk::Disk::open(&config.path, !config.read_only)?;
        let size = image.size();
        if size % SECTOR_SIZE != 0 {
            tracing::warn!(
                "disk image {} is not a multiple of 512 bytes; the last {} bytes are not visible",
                config.path.display(),
                size % SECTOR_SIZE
            );
        }
        let nsectors = size / SECTOR_SIZE;

        let mut avail_features = (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_BLK_F_FLUSH)
            | (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1u64 << VIRTIO_BLK_F_BLK_SIZE);
        if config.read_only {
            avail_features |= 1u64 << VIRTIO_BLK_F_RO;
        } else {
            // Cheap on qcow2 (clusters are dropped) and raw (hole punching).
            avail_features |= (1u64 << VIRTIO_BLK_F_DISCARD) | (1u64 << VIRTIO_BLK_F_WRITE_ZEROES);
        }

        // struct virtio_blk_config: capacity (0), size_max (8), seg_max (12),
        // geometry (16), blk_size (20), topology (24..32), writeback (32),
        // max_discard_sectors (36), max_discard_seg (40),
        // discard_sector_alignment (44), max_write_zeroes_sectors (48),
        // max_write_zeroes_seg (52), write_zeroes_may_unmap (56).
        let mut config_space = [0u8; 60];
        config_space[0..8].copy_from_slice(&nsectors.to_le_bytes());
        let seg_max = u32::from(QUEUE_SIZE) - 2;
        config_space[12..16].copy_from_slice(&seg_max.to_le_bytes());
        config_space[20..24].copy_from_slice(&(SECTOR_SIZE as u32).to_le_bytes());
        let max_sectors = request::MAX_DISCARD_SECTORS.to_le_bytes();
        let max_seg = request::MAX_DISCARD_SEGMENTS.to_le_bytes();
        config_space[36..40].copy_from_slice(&max_sectors);
        config_space[40..44].copy_from_slice(&max_seg);
        config_space[44..48].copy_from_slice(&1u32.to_le_bytes());
        config_space[48..52].copy_from_slice(&max_sectors);
        config_space[52..56].copy_from_slice(&max_seg);

        let base = DeviceBase::new(
            "virtio-blk",
            VIRTIO_ID_BLOCK,
            avail_features,
            &[QUEUE_SIZE],
            &config_space,
        )
        .map_err(BlockError::EventFd)?;
        Ok(Self {
            disk: Disk {
                image,
                nsectors,
                read_only: config.read_only,
                id: id_bytes,
                buf: Vec::new(),
            },
            config,
            base,
            active: None,
        })
    }

    /// The configuration the device was built from.
    pub fn config(&self) -> &BlockConfig {
        &self.config
    }

    /// Disk size in 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.disk.nsectors
    }

    /// Features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.base.acked_features()
    }

    /// The queue's notification eventfd, once activated.
    pub(super) fn queue_evt(&self) -> Option<&EventFd> {
        self.active.as_ref().map(|a| &a.queue_evts[0])
    }

    /// Serves every available request; raises the interrupt if the driver
    /// wants one.
    pub(super) fn process_queue(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = &active.mem;
        let queue = &mut active.queues[0];
        let mut used_any = false;
        while let Some(chain) = self.base.pop_chain(queue, mem) {
            let head = chain.head_index();
            let len = match ChainBuffers::parse(chain) {
                Ok(bufs) => request::execute(&mut self.disk, mem, &bufs, &mut self.base.warnings),
                Err(e) => {
                    self.base.warn(format_args!("{e}"));
                    0
                }
            };
            if let Err(e) = queue.add_used(mem, head, len) {
                self.base
                    .warn(format_args!("cannot return request {head}: {e}"));
                break;
            }
            used_any = true;
        }
        if used_any {
            signal_used(queue, mem, &active.interrupt, self.base.name());
        }
    }
}

/// A block device keeps no guest-visible state of its own: its features
/// are in the transport, its data on the disk, which the host side names.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockState {}

impl crate::persist::Persist for Block {
    type State = BlockState;
    type ConstructorArgs = BlockConfig;
    type Error = BlockError;

    fn save(&self) -> Result<BlockState, BlockError> {
        Ok(BlockState {})
    }

    fn restore(config: BlockConfig, _: &BlockState) -> Result<Self, BlockError> {
        Block::new(config)
    }
}

impl VirtioDevice for Block {
    fn save_device(&self) -> VirtioDeviceState {
        VirtioDeviceState::Block(BlockState {})
    }

    fn load_device(&mut self, state: &VirtioDeviceState) -> Result<(), String> {
        match state {
            VirtioDeviceState::Block(BlockState {}) => Ok(()),
            other => Err(format!(
                "block state expected, {} state saved",
                other.kind()
            )),
        }
    }

    fn host_disk(&mut self) -> Option<&mut disk::Disk> {
        (!self.disk.read_only).then_some(&mut self.disk.image)
    }

    fn base(&self) -> &DeviceBase {
        &self.base
    }

    fn base_mut(&mut self) -> &mut DeviceBase {
        &mut self.base
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        queues: Vec<Queue>,
        queue_evts: Vec<EventFd>,
    ) -> Result<(), ActivateError> {
        if self.active.is_some() {
            return Err(ActivateError::Device("already activated".into()));
        }
        self.active = Some(ActiveQueues::new(mem, interrupt, queues, queue_evts)?);
        self.base.signal_activation()
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    fn active_queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| &a.queues[..])
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
    use virtio_bindings::virtio_blk::{
        VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
        VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
        VIRTIO_BLK_T_WRITE_ZEROES,
    };
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::tempfile::TempFile;

    use super::*;
    use crate::devices::virtio::mmio::testing::{linux_probe, wr};
    use crate::devices::virtio::mmio::{MmioTransport, QUEUE_NOTIFY_OFFSET};
    use crate::devices::virtio::queue::testing::{TestQueue, F_WRITE};
    use crate::devices::virtio::VIRTIO_MMIO_INT_VRING;

    type Em = EventManager<Arc<std::sync::Mutex<dyn MutEventSubscriber + Send>>>;

    const DISK_SECTORS: u64 = 64;
    const HDR: u64 = 0x8_0000;
    const STATUS: u64 = 0x8_1000;
    const DATA: u64 = 0x10_0000;
    const OUTSIDE: u64 = 0x1_0000_0000;

    struct Rig {
        file: TempFile,
        mem: GuestMemoryMmap,
        blk: Arc<Mutex<Block>>,
        transport: MmioTransport,
        em: Em,
        q: TestQueue,
    }

    impl Rig {
        fn new(read_only: bool) -> Self {
            let file = TempFile::new().expect("temp file");
            let content: Vec<u8> = (0..DISK_SECTORS * SECTOR_SIZE)
                .map(|i| (i / 512) as u8)
                .collect();
            std::fs::write(file.as_path(), &content).expect("write image");
            let blk = Block::new(BlockConfig {
                path: file.as_path().to_path_buf(),
                read_only,
                id: Some("disk-0".into()),
            })
            .expect("block");
            let blk = Arc::new(Mutex::new(blk));
            let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).expect("mem");
            let mut transport = MmioTransport::new(mem.clone(), blk.clone()).expect("transport");
            let mut em = Em::new().expect("event manager");
            em.add_subscriber(blk.clone());
            let q = TestQueue::new(&mem, 0x1_0000, QUEUE_SIZE);
            let flush = 1u64 << VIRTIO_BLK_F_FLUSH;
            assert_eq!(
                linux_probe(&mut transport, flush, std::slice::from_ref(&q)),
                0xf
            );
            em.run_with_timeout(100).expect("activate");
            assert!(blk.lock().expect("lock").is_activated());
            Self {
                file,
                mem,
                blk,
                transport,
                em,
                q,
            }
        }

        fn header(&self, kind: u32, sector: u64) {
            self.mem.write_obj(kind, GuestAddress(HDR)).expect("hdr");
            self.mem
                .write_obj(0u32, GuestAddress(HDR + 4))
                .expect("hdr");
            self.mem
                .write_obj(sector, GuestAddress(HDR + 8))
                .expect("hdr");
        }

        /// Publishes a chain, kicks the queue, waits for the used entry;
        /// returns (used len, status byte).
        fn submit(&mut self, bufs: &[(u64, u32, u16)]) -> (u32, u8) {
            self.mem
                .write_obj(0xffu8, GuestAddress(STATUS))
                .expect("status");
            let before = self.q.used_idx(&self.mem);
            let head = self.q.add_chain(&self.mem, bufs);
            wr(&mut self.transport, QUEUE_NOTIFY_OFFSET, 0);
            for _ in 0..50 {
                if self.q.used_idx(&self.mem) != before {
                    break;
                }
                self.em.run_with_timeout(100).expect("run");
            }
            assert_eq!(
                self.q.used_idx(&self.mem),
                before.wrapping_add(1),
                "request completed"
            );
            let (id, len) = self.q.used_elem(&self.mem, before);
            assert_eq!(id, u32::from(head));
            let status: u8 = self.mem.read_obj(GuestAddress(STATUS)).expect("status");
            (len, status)
        }

        fn file_bytes(&self) -> Vec<u8> {
            std::fs::read(self.file.as_path()).expect("read image")
        }
    }

    #[test]
    fn test_block_write_then_read_reaches_host_file() {
        let mut rig = Rig::new(false);
        let data: Vec<u8> = (0..1024u32).map(|i| (i * 7) as u8).collect();
        rig.mem
            .write_slice(&data, GuestAddress(DATA))
            .expect("data");
        rig.header(VIRTIO_BLK_T_OUT, 3);

        let res = rig.submit(&[(HDR, 16, 0), (DATA, 1024, 0), (STATUS, 1, F_WRITE)]);

        assert_eq!(res, (1, VIRTIO_BLK_S_OK as u8));
        let file = rig.file_bytes();
        assert_eq!(&file[3 * 512..5 * 512], &data[..]);
        assert_eq!(file[2 * 512], 2);
        assert_eq!(file[5 * 512], 5);
        assert_ne!(
            rig.transport.interrupt().status() & VIRTIO_MMIO_INT_VRING,
            0
        );

        // Read back sectors 2..6 into two buffers.
        rig.header(VIRTIO_BLK_T_IN, 2);
        let res = rig.submit(&[
            (HDR, 16, 0),
            (DATA + 0x1_0000, 1024, F_WRITE),
            (DATA + 0x2_0000, 1024, F_WRITE),
            (STATUS, 1, F_WRITE),
        ]);
        assert_eq!(res, (2049, VIRTIO_BLK_S_OK as u8));
        let mut got = vec![0u8; 1024];
        rig.mem
            .read_slice(&mut got, GuestAddress(DATA + 0x1_0000))
            .expect("read");
        assert!(got[..512].iter().all(|&b| b == 2));
        assert_eq!(&got[512..], &data[..512]);
        rig.mem
            .read_slice(&mut got, GuestAddress(DATA + 0x2_0000))
            .expect("read");
        assert_eq!(&got[..512], &data[512..]);
        assert!(got[512..].iter().all(|&b| b == 5));
    }

    #[test]
    fn test_block_any_layout_header_and_data_in_one_buffer() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_OUT, 0);
        rig.mem
            .write_slice(&[0xab; 512], GuestAddress(HDR + 16))
            .expect("data");
        let res = rig.submit(&[(HDR, 16 + 512, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_OK as u8));
        assert!(rig.file_bytes()[..512].iter().all(|&b| b == 0xab));
    }

    #[test]
    fn test_block_flush_and_get_id() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(
            rig.submit(&[(HDR, 16, 0), (STATUS, 1, F_WRITE)]),
            (1, VIRTIO_BLK_S_OK as u8)
        );

        rig.header(VIRTIO_BLK_T_GET_ID, 0);
        let res = rig.submit(&[(HDR, 16, 0), (DATA, 20, F_WRITE), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (21, VIRTIO_BLK_S_OK as u8));
        let mut id = [0u8; 20];
        rig.mem.read_slice(&mut id, GuestAddress(DATA)).expect("id");
        assert_eq!(&id[..6], b"disk-0");
        assert!(id[6..].iter().all(|&b| b == 0));
    }

    #[test]
    fn test_block_out_of_range_sectors_ioerr() {
        let mut rig = Rig::new(false);
        for sector in [DISK_SECTORS - 1, DISK_SECTORS, u64::MAX, u64::MAX / 512] {
            rig.header(VIRTIO_BLK_T_IN, sector);
            let res = rig.submit(&[(HDR, 16, 0), (DATA, 1024, F_WRITE), (STATUS, 1, F_WRITE)]);
            assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8), "sector {sector}");
            rig.header(VIRTIO_BLK_T_OUT, sector);
            let res = rig.submit(&[(HDR, 16, 0), (DATA, 1024, 0), (STATUS, 1, F_WRITE)]);
            assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8), "sector {sector}");
        }
        assert_eq!(rig.file_bytes().len() as u64, DISK_SECTORS * 512);
        // The last sector itself is fine.
        rig.header(VIRTIO_BLK_T_IN, DISK_SECTORS - 1);
        let res = rig.submit(&[(HDR, 16, 0), (DATA, 512, F_WRITE), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (513, VIRTIO_BLK_S_OK as u8));
    }

    #[test]
    fn test_block_bad_chains_give_error_status_not_panic() {
        let mut rig = Rig::new(false);
        // Data buffer outside guest memory.
        rig.header(VIRTIO_BLK_T_IN, 0);
        let res = rig.submit(&[(HDR, 16, 0), (OUTSIDE, 512, F_WRITE), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8));
        rig.header(VIRTIO_BLK_T_OUT, 0);
        let res = rig.submit(&[(HDR, 16, 0), (OUTSIDE, 512, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8));
        // Header outside guest memory, or too short.
        let res = rig.submit(&[(OUTSIDE, 16, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8));
        rig.header(VIRTIO_BLK_T_FLUSH, 0);
        let res = rig.submit(&[(HDR, 8, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8));
        // Length not a multiple of the sector size.
        rig.header(VIRTIO_BLK_T_IN, 0);
        let res = rig.submit(&[(HDR, 16, 0), (DATA, 100, F_WRITE), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8));
        // Unknown request type.
        rig.header(99, 0);
        let res = rig.submit(&[(HDR, 16, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_UNSUPP as u8));
        // Zero-length status descriptor: nothing to report into.
        rig.header(VIRTIO_BLK_T_FLUSH, 0);
        let res = rig.submit(&[(HDR, 16, 0), (STATUS, 0, F_WRITE)]);
        assert_eq!(res, (0, 0xff));
        // Status descriptor outside guest memory.
        let res = rig.submit(&[(HDR, 16, 0), (OUTSIDE, 1, F_WRITE)]);
        assert_eq!(res, (0, 0xff));
        // Readable after writable.
        let res = rig.submit(&[(HDR, 16, 0), (STATUS, 1, F_WRITE), (DATA, 16, 0)]);
        assert_eq!(res, (0, 0xff));
        // The device still works.
        rig.header(VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(
            rig.submit(&[(HDR, 16, 0), (STATUS, 1, F_WRITE)]),
            (1, VIRTIO_BLK_S_OK as u8)
        );
    }

    #[test]
    fn test_block_read_only_rejects_writes() {
        let mut rig = Rig::new(true);
        let blk = rig.blk.lock().expect("lock");
        assert_ne!(blk.avail_features() & (1 << VIRTIO_BLK_F_RO), 0);
        drop(blk);
        let before = rig.file_bytes();
        rig.header(VIRTIO_BLK_T_OUT, 0);
        let res = rig.submit(&[(HDR, 16, 0), (DATA, 512, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8));
        assert_eq!(rig.file_bytes(), before);
    }

    #[test]
    fn test_block_config_space_capacity() {
        let rig = Rig::new(false);
        let blk = rig.blk.lock().expect("lock");
        let mut cap = [0u8; 8];
        blk.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), DISK_SECTORS);
        let mut b = [0xffu8; 4];
        blk.read_config(20, &mut b);
        assert_eq!(u32::from_le_bytes(b), 512);
        blk.read_config(0x1000, &mut b);
        assert_eq!(b, [0; 4]);
    }

    #[test]
    fn test_block_missing_image_clear_error() {
        let err = Block::new(BlockConfig {
            path: "/nonexistent/x.raw".into(),
            read_only: false,
            id: None,
        })
        .expect_err("missing file");
        assert!(
            matches!(err, BlockError::Open(disk::DiskError::Missing { .. })),
            "{err:?}"
        );
        let source = std::error::Error::source(&err)
            .map(ToString::to_string)
            .unwrap_or_default();
        assert!(
            source.starts_with("/nonexistent/x.raw: no such file"),
            "{source}"
        );
        let long = Block::new(BlockConfig {
            path: "/nonexistent/x.raw".into(),
            read_only: false,
            id: Some("x".repeat(21)),
        });
        assert!(matches!(long, Err(BlockError::IdTooLong(_))));
    }

    #[test]
    fn test_block_write_zeroes_and_discard_check_segments() {
        let mut rig = Rig::new(false);
        let seg = |sector: u64, num: u32, flags: u32| {
            let mut b = sector.to_le_bytes().to_vec();
            b.extend_from_slice(&num.to_le_bytes());
            b.extend_from_slice(&flags.to_le_bytes());
            b
        };
        // WRITE_ZEROES of sectors 3..5 (unmap allowed) zeroes exactly them.
        rig.mem
            .write_slice(&seg(3, 2, 1), GuestAddress(DATA))
            .expect("seg");
        rig.header(VIRTIO_BLK_T_WRITE_ZEROES, 0);
        let res = rig.submit(&[(HDR, 16, 0), (DATA, 16, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_OK as u8));
        let bytes = rig.file_bytes();
        assert!(bytes[3 * 512..5 * 512].iter().all(|b| *b == 0));
        assert_eq!(bytes[2 * 512], 2);
        assert_eq!(bytes[5 * 512], 5);
        // DISCARD of a valid range succeeds.
        rig.mem
            .write_slice(&seg(6, 1, 0), GuestAddress(DATA))
            .expect("seg");
        rig.header(VIRTIO_BLK_T_DISCARD, 0);
        let res = rig.submit(&[(HDR, 16, 0), (DATA, 16, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_OK as u8));
        // Unknown flags, a range past the end, no segments: refused, nothing zeroed.
        rig.mem
            .write_slice(&seg(8, 1, 1), GuestAddress(DATA))
            .expect("seg");
        let res = rig.submit(&[(HDR, 16, 0), (DATA, 16, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_UNSUPP as u8));
        rig.mem
            .write_slice(&seg(DISK_SECTORS - 1, 2, 0), GuestAddress(DATA))
            .expect("seg");
        let res = rig.submit(&[(HDR, 16, 0), (DATA, 16, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8));
        let res = rig.submit(&[(HDR, 16, 0), (STATUS, 1, F_WRITE)]);
        assert_eq!(res, (1, VIRTIO_BLK_S_IOERR as u8));
        assert_eq!(rig.file_bytes()[8 * 512], 8);
    }
}

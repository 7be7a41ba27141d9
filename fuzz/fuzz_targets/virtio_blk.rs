#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| vmm::fuzz::virtio_blk(data));

#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| contract::fuzz::contract_toml(data));

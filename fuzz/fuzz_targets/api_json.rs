#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tined::fuzz::api_json(data));

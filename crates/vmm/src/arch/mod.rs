//! Architecture support. tine runs on x86_64 only for now.

pub mod x86_64;

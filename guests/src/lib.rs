//! Micro guest paths.

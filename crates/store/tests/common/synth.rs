//! Synthetic guest-memory-like images, shared by the tests and the bench
//! example (`#[path]`-included there).

pub const PAGE: usize = 4096;

/// xorshift64*: deterministic, fast, good enough for test bytes.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

const WORDS: &[&str] = &[
    "the ",
    "kernel ",
    "page ",
    "struct ",
    "return ",
    "static ",
    "int ",
    "void ",
    "if (",
    ") {\n",
    "}\n",
    "0x",
    "ffff",
    "init",
    "_task",
    "mutex_lock(&",
    "->next",
    "NULL",
    "error",
    "; ",
    "\t",
    "usr/lib/",
    "libc.so.6",
    "GLIBC_2.",
    "ELF",
    "bash",
    "PATH=",
    "HOME=/root",
    "en_US.UTF-8",
];

/// Fills one 4 KiB page with content of `kind`: 0 zero, 1 text/code-like,
/// 2 pointer-rich structures, 3 random (compressed or encrypted data).
pub fn fill_page(rng: &mut Rng, kind: u64, page: &mut [u8]) {
    match kind {
        0 => page.fill(0),
        1 => {
            let mut i = 0;
            while i < page.len() {
                let w = WORDS[rng.below(WORDS.len() as u64) as usize].as_bytes();
                let n = w.len().min(page.len() - i);
                page[i..i + n].copy_from_slice(&w[..n]);
                i += n;
            }
        }
        2 => {
            let base = 0xffff_8880_0000_0000u64 + (rng.below(1 << 20) << 12);
            for (j, c) in page.chunks_mut(8).enumerate() {
                let v = match rng.below(4) {
                    0 => 0,
                    1 => base + (j as u64) * 64,
                    2 => rng.below(256),
                    _ => base + rng.below(1 << 16),
                };
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => rng.fill(page),
    }
}

/// A guest-memory-like image: runs of pages (1..64 long) of one kind,
/// about 40% zero, 25% text/code, 20% structures, 15% random, and some
/// pages repeated elsewhere (page cache of shared files).
pub fn synthetic_memory(size: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; size];
    let mut rng = Rng(seed | 1);
    let pages = size / PAGE;
    let mut p = 0;
    let mut last_nonzero: Option<usize> = None;
    while p < pages {
        let run = (1 + rng.below(64) as usize).min(pages - p);
        let r = rng.below(100);
        let kind = match r {
            0..=39 => 0,
            40..=64 => 1,
            65..=84 => 2,
            _ => 3,
        };
        for q in p..p + run {
            if kind != 0 && rng.below(20) == 0 {
                if let Some(src) = last_nonzero {
                    // A duplicate of an earlier page.
                    let (a, b) = v.split_at_mut(q * PAGE);
                    b[..PAGE].copy_from_slice(&a[src * PAGE..src * PAGE + PAGE]);
                    continue;
                }
            }
            fill_page(&mut rng, kind, &mut v[q * PAGE..(q + 1) * PAGE]);
            if kind != 0 {
                last_nonzero = Some(q.saturating_sub(rng.below(4096) as usize));
            }
        }
        p += run;
    }
    v
}

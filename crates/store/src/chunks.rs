//! Chunk reads and writes over a backend, with a local cache in front of
//! a remote one. Every read is verified: decompressed and hashed again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend::{Backend, BackendError, LocalBackend};
use crate::chunk::{self, ChunkId, DecodeError};

/// Why a chunk could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    #[error("chunk {chunk} is missing from {backend}")]
    Missing { chunk: ChunkId, backend: String },
    #[error("chunk {chunk} in {backend} is corrupt: {reason}")]
    Corrupt {
        chunk: ChunkId,
        backend: String,
        #[source]
        reason: DecodeError,
    },
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl ChunkError {
    /// The chunk it concerns, if one.
    pub fn chunk(&self) -> Option<ChunkId> {
        match self {
            ChunkError::Missing { chunk, .. } | ChunkError::Corrupt { chunk, .. } => Some(*chunk),
            ChunkError::Backend(_) => None,
        }
    }
}

/// Counters of chunk traffic since the store was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChunkCounters {
    /// Reads served by the local cache.
    pub cache_hits: u64,
    /// Reads that went to the backend.
    pub backend_reads: u64,
    /// Stored bytes read from the backend.
    pub backend_read_bytes: u64,
    /// Puts to the backend.
    pub puts: u64,
    /// Stored bytes put.
    pub put_bytes: u64,
    /// Cache copies that failed their hash check (and were fetched again).
    pub cache_corrupt: u64,
}

#[derive(Debug, Default)]
struct Counters {
    cache_hits: AtomicU64,
    backend_reads: AtomicU64,
    backend_read_bytes: AtomicU64,
    puts: AtomicU64,
    put_bytes: AtomicU64,
    cache_corrupt: AtomicU64,
}

/// The chunk layer of a store: a backend and, for a remote one, a cache.
#[derive(Debug)]
pub struct Chunks {
    backend: Arc<dyn Backend>,
    cache: Option<LocalBackend>,
    level: i32,
    counters: Counters,
}

impl Chunks {
    pub fn new(backend: Arc<dyn Backend>, cache: Option<LocalBackend>, level: i32) -> Chunks {
        Chunks {
            backend,
            cache,
            level,
            counters: Counters::default(),
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn cache(&self) -> Option<&LocalBackend> {
        self.cache.as_ref()
    }

    /// The stored form of `data`.
    pub fn encode(&self, data: &[u8]) -> std::io::Result<Vec<u8>> {
        chunk::encode(data, self.level)
    }

    /// Puts a chunk's stored form: durable in the backend when this
    /// returns, and written through to the cache.
    pub fn put(&self, id: &ChunkId, stored: &[u8]) -> Result<(), BackendError> {
        self.backend.put(id, stored)?;
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.counters
            .put_bytes
            .fetch_add(stored.len() as u64, Ordering::Relaxed);
        if let Some(c) = &self.cache {
            if let Err(e) = c.put(id, stored) {
                tracing::warn!("chunk cache: {e}");
            }
        }
        Ok(())
    }

    /// The bytes of chunk `id` (at most `limit` of them), from the cache
    /// or else the backend, verified. A cache copy that fails its check is
    /// dropped and fetched again; a backend copy that fails is an error.
    pub fn get(&self, id: &ChunkId, limit: usize) -> Result<Vec<u8>, ChunkError> {
        if let Some(c) = &self.cache {
            match c.get(id) {
                Ok(Some(b)) => match chunk::decode(id, &b, limit) {
                    Ok(d) => {
                        self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
                        c.touch(id);
                        return Ok(d);
                    }
                    Err(e) => {
                        self.counters.cache_corrupt.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            "chunk cache: {} is corrupt ({e}); fetching it again",
                            c.path_of(id).display()
                        );
                        let _ = c.delete(id);
                    }
                },
                Ok(None) => {}
                Err(e) => tracing::warn!("chunk cache: {e}"),
            }
        }
        let stored = self.get_backend(id)?;
        let data = chunk::decode(id, &stored, limit).map_err(|reason| ChunkError::Corrupt {
            chunk: *id,
            backend: self.backend.describe(),
            reason,
        })?;
        if let Some(c) = &self.cache {
            if let Err(e) = c.put(id, &stored) {
                tracing::warn!("chunk cache: {e}");
            }
        }
        Ok(data)
    }

    fn get_backend(&self, id: &ChunkId) -> Result<Vec<u8>, ChunkError> {
        let stored = self.backend.get(id)?.ok_or_else(|| ChunkError::Missing {
            chunk: *id,
            backend: self.backend.describe(),
        })?;
        self.counters.backend_reads.fetch_add(1, Ordering::Relaxed);
        self.counters
            .backend_read_bytes
            .fetch_add(stored.len() as u64, Ordering::Relaxed);
        Ok(stored)
    }

    /// Checks the backend's copy of `id` (never the cache): returns its
    /// stored size.
    pub fn verify_backend(&self, id: &ChunkId, limit: usize) -> Result<u64, ChunkError> {
        let stored = self.get_backend(id)?;
        chunk::decode(id, &stored, limit).map_err(|reason| ChunkError::Corrupt {
            chunk: *id,
            backend: self.backend.describe(),
            reason,
        })?;
        Ok(stored.len() as u64)
    }

    /// Brings `id` into the cache (verified) unless it is there; returns
    /// the stored bytes fetched (0 when cached or without a cache).
    pub fn prefetch(&self, id: &ChunkId, limit: usize) -> Result<u64, ChunkError> {
        let Some(c) = &self.cache else { return Ok(0) };
        if c.exists(id)? {
            return Ok(0);
        }
        let stored = self.get_backend(id)?;
        chunk::decode(id, &stored, limit).map_err(|reason| ChunkError::Corrupt {
            chunk: *id,
            backend: self.backend.describe(),
            reason,
        })?;
        c.put(id, &stored)?;
        Ok(stored.len() as u64)
    }

    /// Deletes `id` from the backend and the cache.
    pub fn delete(&self, id: &ChunkId) -> Result<(), BackendError> {
        self.backend.delete(id)?;
        if let Some(c) = &self.cache {
            c.delete(id)?;
        }
        Ok(())
    }

    /// Counters since open.
    pub fn counters(&self) -> ChunkCounters {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ChunkCounters {
            cache_hits: l(&c.cache_hits),
            backend_reads: l(&c.backend_reads),
            backend_read_bytes: l(&c.backend_read_bytes),
            puts: l(&c.puts),
            put_bytes: l(&c.put_bytes),
            cache_corrupt: l(&c.cache_corrupt),
        }
    }
}

//! The S3 backend: chunks as objects `PREFIX/chunks/ab/cdef…` in a bucket
//! of any S3-compatible server, through the `object_store` crate.
//!
//! `object_store` is async; the store is not (the VMM has no async
//! runtime and fork(2)s). This backend owns a small tokio runtime and
//! blocks on it from the caller's threads (many at once: puts and gets
//! run in parallel). A runtime's threads do not survive fork(2), so the
//! runtime and the HTTP client are built lazily per process: a forked
//! child that uses the backend gets its own.

use std::sync::{Arc, Mutex};

use futures::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::backend::{Backend, BackendError};
use crate::chunk::ChunkId;

/// Where the bucket is and how to reach it.
#[derive(Clone, Debug, Default)]
pub struct S3Config {
    pub bucket: String,
    /// Key prefix inside the bucket ("" for none).
    pub prefix: String,
    /// `http://127.0.0.1:3900` for a local server; None: AWS.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    /// Allow plain http endpoints (local test servers).
    pub allow_http: bool,
}

impl S3Config {
    /// From `s3://bucket[/prefix]`; endpoint, region, keys and
    /// `AWS_ALLOW_HTTP` from the usual `AWS_*` environment variables
    /// (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`), which `object_store` reads.
    pub fn from_url(url: &str) -> Result<S3Config, BackendError> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| BackendError::S3Config(format!("{url:?} is not an s3:// url")))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(BackendError::S3Config(format!("{url:?} names no bucket")));
        }
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Ok(S3Config {
            bucket: bucket.into(),
            prefix: prefix.trim_matches('/').into(),
            endpoint: env("AWS_ENDPOINT_URL").or_else(|| env("AWS_ENDPOINT")),
            region: env("AWS_REGION").or_else(|| env("AWS_DEFAULT_REGION")),
            access_key_id: env("AWS_ACCESS_KEY_ID"),
            secret_access_key: env("AWS_SECRET_ACCESS_KEY"),
            allow_http: env("AWS_ALLOW_HTTP").is_some_and(|v| v == "true" || v == "1"),
        })
    }

    /// `s3://bucket/prefix`.
    pub fn url(&self) -> String {
        if self.prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.prefix)
        }
    }

    fn build(&self) -> Result<AmazonS3, BackendError> {
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&self.bucket)
            .with_region(self.region.clone().unwrap_or_else(|| "us-east-1".into()))
            .with_allow_http(self.allow_http);
        if let Some(e) = &self.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(k) = &self.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(k) = &self.secret_access_key {
            b = b.with_secret_access_key(k);
        }
        b.build().map_err(|source| BackendError::S3 {
            url: self.url(),
            source,
        })
    }
}

struct Client {
    pid: u32,
    rt: tokio::runtime::Runtime,
    s3: AmazonS3,
}

/// Chunks in an S3 bucket.
pub struct S3Backend {
    cfg: S3Config,
    client: Mutex<Option<Arc<Client>>>,
}

impl std::fmt::Debug for S3Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "S3Backend({})", self.cfg.url())
    }
}

impl S3Backend {
    /// A backend for `cfg`; checks the configuration (not the server).
    pub fn new(cfg: S3Config) -> Result<S3Backend, BackendError> {
        cfg.build()?;
        Ok(S3Backend {
            cfg,
            client: Mutex::new(None),
        })
    }

    fn client(&self) -> Result<Arc<Client>, BackendError> {
        let pid = std::process::id();
        let mut g = self.client.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = g.as_ref() {
            if c.pid == pid {
                return Ok(c.clone());
            }
            // Inherited over fork(2): its runtime threads do not exist
            // here, and dropping it would wait for them forever.
            if let Some(old) = g.take() {
                std::mem::forget(old);
            }
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tine-store-s3")
            .enable_all()
            .build()
            .map_err(|source| BackendError::Io {
                path: "tokio runtime".into(),
                source,
            })?;
        let c = Arc::new(Client {
            pid,
            rt,
            s3: self.cfg.build()?,
        });
        *g = Some(c.clone());
        Ok(c)
    }

    fn key(&self, id: &ChunkId) -> ObjPath {
        let hex = id.to_hex();
        ObjPath::from(format!(
            "{}/{}/{}",
            self.chunks_prefix(),
            &hex[..2],
            &hex[2..]
        ))
    }

    fn chunks_prefix(&self) -> String {
        if self.cfg.prefix.is_empty() {
            "chunks".into()
        } else {
            format!("{}/chunks", self.cfg.prefix)
        }
    }

    fn err(&self, id: Option<&ChunkId>, source: object_store::Error) -> BackendError {
        let url = match id {
            Some(id) => format!("{}/{}", self.cfg.url(), self.key(id)),
            None => self.cfg.url(),
        };
        BackendError::S3 { url, source }
    }

    /// Creates the bucket's marker object, to check the server answers
    /// and the credentials work (buckets themselves are made by the
    /// server's admin tools).
    pub fn check(&self) -> Result<(), BackendError> {
        let c = self.client()?;
        let key = ObjPath::from(format!("{}/.tine-store", self.chunks_prefix()));
        c.rt.block_on(c.s3.put(&key, PutPayload::from_static(b"tine chunk store\n")))
            .map(|_| ())
            .map_err(|e| self.err(None, e))
    }
}

impl Backend for S3Backend {
    fn describe(&self) -> String {
        self.cfg.url()
    }

    fn put(&self, id: &ChunkId, data: &[u8]) -> Result<(), BackendError> {
        let c = self.client()?;
        let payload = PutPayload::from(data.to_vec());
        // A PUT is atomic on S3, and acknowledged only once stored.
        c.rt.block_on(c.s3.put(&self.key(id), payload))
            .map(|_| ())
            .map_err(|e| self.err(Some(id), e))
    }

    fn get(&self, id: &ChunkId) -> Result<Option<Vec<u8>>, BackendError> {
        let c = self.client()?;
        let key = self.key(id);
        let r = c.rt.block_on(async {
            let g = c.s3.get(&key).await?;
            g.bytes().await
        });
        match r {
            Ok(b) => Ok(Some(b.to_vec())),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err(Some(id), e)),
        }
    }

    fn get_range(
        &self,
        id: &ChunkId,
        range: std::ops::Range<u64>,
    ) -> Result<Option<Vec<u8>>, BackendError> {
        let c = self.client()?;
        match c.rt.block_on(c.s3.get_range(&self.key(id), range)) {
            Ok(b) => Ok(Some(b.to_vec())),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err(Some(id), e)),
        }
    }

    fn get_range_streamed(
        &self,
        id: &ChunkId,
        range: std::ops::Range<u64>,
        sink: &mut dyn FnMut(&[u8]) -> bool,
    ) -> Result<bool, BackendError> {
        use futures::StreamExt;
        let c = self.client()?;
        let key = self.key(id);
        let r = c.rt.block_on(async {
            let opts = object_store::GetOptions::default()
                .with_range(Some(object_store::GetRange::Bounded(range)));
            let mut st = c.s3.get_opts(&key, opts).await?.into_stream();
            while let Some(b) = st.next().await {
                if !sink(&b?) {
                    break;
                }
            }
            Ok::<(), object_store::Error>(())
        });
        match r {
            Ok(()) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.err(Some(id), e)),
        }
    }

    fn exists(&self, id: &ChunkId) -> Result<bool, BackendError> {
        let c = self.client()?;
        match c.rt.block_on(c.s3.head(&self.key(id))) {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.err(Some(id), e)),
        }
    }

    fn delete(&self, id: &ChunkId) -> Result<(), BackendError> {
        let c = self.client()?;
        match c.rt.block_on(c.s3.delete(&self.key(id))) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err(Some(id), e)),
        }
    }

    fn list(&self) -> Result<Vec<ChunkId>, BackendError> {
        let c = self.client()?;
        let prefix = ObjPath::from(self.chunks_prefix());
        let metas: Vec<object_store::ObjectMeta> =
            c.rt.block_on(c.s3.list(Some(&prefix)).try_collect())
                .map_err(|e| self.err(None, e))?;
        let mut out = Vec::with_capacity(metas.len());
        for m in metas {
            let parts: Vec<_> = m.location.parts().collect();
            if parts.len() < 2 {
                continue;
            }
            let hex = format!(
                "{}{}",
                parts[parts.len() - 2].as_ref(),
                parts[parts.len() - 1].as_ref()
            );
            if let Ok(id) = hex.parse() {
                out.push(id);
            }
        }
        Ok(out)
    }
}

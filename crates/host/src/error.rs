//! The one error type of the engine library: what went wrong, as a message
//! a human should read, and a [`Code`] that says what kind of failure it
//! is (tined turns it into an HTTP status, the CLI into its exit).
//!
//! Errors of the crates below keep their own types (`source` chains);
//! [`Context`] adds what the engine was doing, the way anyhow's does.

use serde::{Deserialize, Serialize};

/// What kind of failure an [`Error`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Code {
    /// The request itself is wrong (a bad name, a bad contract, a limit).
    InvalidInput,
    /// What it names does not exist.
    NotFound,
    /// It clashes with what exists (a name in use, a vm in the wrong state).
    Conflict,
    /// Another operation holds the vm; try again.
    Busy,
    /// Tried and failed (the VMM, the guest, the store said no).
    Failed,
    /// A fault of the host itself (I/O, a corrupt record).
    Internal,
}

impl Code {
    /// The snake_case name, as in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidInput => "invalid_input",
            Code::NotFound => "not_found",
            Code::Conflict => "conflict",
            Code::Busy => "busy",
            Code::Failed => "failed",
            Code::Internal => "internal",
        }
    }
}

/// An engine error. Display prints the whole chain on one line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error the engine itself found, with its kind.
    #[error("{message}")]
    Engine { code: Code, message: String },
    /// What the engine was doing when `source` happened.
    #[error("{context}: {source}")]
    Context {
        context: String,
        #[source]
        source: Box<Error>,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Disk(#[from] disk::DiskError),
    #[error(transparent)]
    Vmm(#[from] vmm::api::ApiError),
    #[error(transparent)]
    SnapshotDir(#[from] vmm::snapshot_dir::SnapshotDirError),
    #[error(transparent)]
    Layer(#[from] vmm::layer::LayerError),
    #[error(transparent)]
    Agent(#[from] protocol::client::ClientError),
    #[error(transparent)]
    Protocol(#[from] protocol::ProtocolError),
    #[error(transparent)]
    Contract(#[from] contract::ContractError),
    #[error(transparent)]
    Effects(#[from] effects::Error),
    #[error(transparent)]
    Image(#[from] image::ImageError),
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Error::Engine {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidInput, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(Code::Conflict, message)
    }
    pub fn busy(message: impl Into<String>) -> Self {
        Self::new(Code::Busy, message)
    }
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(Code::Failed, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// The kind of the innermost engine error (the one that decided the
    /// outcome); errors of lower crates count as failures of the host.
    pub fn code(&self) -> Code {
        match self {
            Error::Engine { code, .. } => *code,
            Error::Context { source, .. } => source.code(),
            Error::Contract(_) => Code::InvalidInput,
            Error::Io(_) | Error::Json(_) => Code::Internal,
            Error::SnapshotDir(e) => snapshot_dir_code(e),
            Error::Image(e) => image_code(e),
            _ => Code::Failed,
        }
    }

    /// Wraps this error in what the caller was doing, keeping its code.
    pub fn context(self, context: impl Into<String>) -> Self {
        Error::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a snapshot directory's error says about the request: a directory
/// that holds no snapshot was named wrongly, one that holds one already is
/// taken.
fn snapshot_dir_code(e: &vmm::snapshot_dir::SnapshotDirError) -> Code {
    use vmm::snapshot_dir::SnapshotDirError as E;
    match e {
        E::NotASnapshot(_) => Code::NotFound,
        E::NotEmpty(_) => Code::Conflict,
        _ => Code::Failed,
    }
}

/// What an image's error says about the request: an image or kernel that
/// is not there, or a file that is no kernel, is the caller's to fix.
fn image_code(e: &image::ImageError) -> Code {
    use image::ImageError as E;
    match e {
        E::UnknownImage { .. } | E::KernelMissing(_) => Code::NotFound,
        E::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => Code::NotFound,
        E::NotAKernel(_) | E::NoAgent { .. } => Code::InvalidInput,
        _ => Code::Failed,
    }
}

/// anyhow-style context on results and options.
pub trait Context<T> {
    fn context(self, context: impl Into<String>) -> Result<T>;
    fn with_context<S: Into<String>>(self, f: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|e| e.into().context(context))
    }
    fn with_context<S: Into<String>>(self, f: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| e.into().context(f()))
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, context: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| Error::failed(context))
    }
    fn with_context<S: Into<String>>(self, f: impl FnOnce() -> S) -> Result<T> {
        self.ok_or_else(|| Error::failed(f()))
    }
}

/// `bail!(Code, "...", args)` or `bail!("...", args)` (a failure).
#[macro_export]
macro_rules! bail {
    (code = $code:expr, $($arg:tt)*) => {
        return Err($crate::Error::new($code, format!($($arg)*)))
    };
    ($($arg:tt)*) => {
        return Err($crate::Error::failed(format!($($arg)*)))
    };
}

/// `ensure!(cond, "...")`: an invalid request unless `cond`.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            return Err($crate::Error::invalid(format!($($arg)*)));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_context_keeps_the_inner_code_and_chains_messages() {
        let e: Result<()> = Err(Error::not_found("no vm named \"a\""));
        let e = e.context("cannot fork \"a\"").expect_err("error");
        assert_eq!(e.code(), Code::NotFound);
        assert_eq!(e.to_string(), "cannot fork \"a\": no vm named \"a\"");
        let io: std::result::Result<(), std::io::Error> =
            Err(std::io::Error::other("disk on fire"));
        let e = io.context("cannot write x").expect_err("error");
        assert_eq!(e.code(), Code::Internal);
        assert_eq!(e.to_string(), "cannot write x: disk on fire");
    }

    #[test]
    fn test_a_missing_snapshot_or_image_is_not_found() {
        let e = Error::from(vmm::snapshot_dir::SnapshotDirError::NotASnapshot(
            "/x".into(),
        ));
        assert_eq!(e.context("cannot restore").code(), Code::NotFound);
        let e = Error::from(vmm::snapshot_dir::SnapshotDirError::NotEmpty("/x".into()));
        assert_eq!(e.code(), Code::Conflict);
        let e = Error::from(image::ImageError::UnknownImage {
            name: "nope".into(),
            dir: "/images".into(),
        });
        assert_eq!(e.code(), Code::NotFound);
        let e = Error::from(image::ImageError::Io {
            path: "/x/manifest.json".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        });
        assert_eq!(e.code(), Code::NotFound);
        let e = Error::from(image::ImageError::NotAKernel("/etc/passwd".into()));
        assert_eq!(e.code(), Code::InvalidInput);
    }
}

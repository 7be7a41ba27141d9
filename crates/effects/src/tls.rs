//! HTTPS interception (`effects.https = "intercept"`): the gateway ends the
//! guest's TLS with a certificate for the CONNECT's host, signed by this
//! host's own CA (which the agent installs in the guest at wake), and opens
//! its own TLS to the destination, verified against the host's roots. What
//! is between is plain HTTP, journaled and replayed exactly like `http://`.
//!
//! The CA is made once per home (`$TINE_HOME/effects/ca.pem`: certificate
//! and key, mode 0600) by whichever of the gateway or the CLI needs it
//! first; leaf certificates are made per host on first use and kept in
//! memory.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::{Error, Paths};

/// Host configuration: a PEM file of extra roots the gateway trusts for
/// destinations, besides the host's own (tests: their own test CA).
pub const EXTRA_ROOTS_ENV: &str = "TINE_GATEWAY_EXTRA_ROOTS";

/// A leaf certificate is valid this long, and made again after half.
const LEAF_DAYS: i64 = 30;
const LEAF_REFRESH: Duration = Duration::from_secs(15 * 24 * 3600);

fn tls_err(what: &str) -> impl Fn(rcgen::Error) -> Error + '_ {
    move |e| Error::Gateway(format!("{what}: {e}"))
}

/// The crypto the gateway uses (one provider, chosen here, so a second one
/// enabled elsewhere in a build cannot make rustls's default ambiguous).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The subject of a CA whose key is `key`: derived from the key, so the
/// issuer of the leaves can be rebuilt from the key alone.
fn ca_params(key: &KeyPair) -> CertificateParams {
    let mut p = CertificateParams::default();
    let id = blake3::hash(key.public_key_raw()).to_hex();
    p.distinguished_name.push(
        DnType::CommonName,
        format!("tine effects gateway CA {}", &id[..12]),
    );
    p.distinguished_name.push(DnType::OrganizationName, "tine");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

/// This host's CA for intercepted HTTPS.
pub struct Ca {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

impl Ca {
    /// Loads the home's CA, making it if there is none (two processes
    /// making it at once both end with the one that was linked first).
    pub fn load_or_create(paths: &Paths) -> Result<Ca, Error> {
        let path = paths.ca();
        match std::fs::read_to_string(&path) {
            Ok(text) => return Ca::parse(&text, &path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::Io(path.display().to_string(), e)),
        }
        std::fs::create_dir_all(&paths.dir)
            .map_err(|e| Error::Io(paths.dir.display().to_string(), e))?;
        let key = KeyPair::generate().map_err(tls_err("CA key"))?;
        let mut params = ca_params(&key);
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::days(1);
        params.not_after = now + time::Duration::days(3650);
        let cert = params
            .self_signed(&key)
            .map_err(tls_err("CA certificate"))?;
        let text = format!("{}{}", cert.pem(), key.serialize_pem());
        let tmp = PathBuf::from(format!("{}.{}.tmp", path.display(), std::process::id()));
        let io = |e| Error::Io(tmp.display().to_string(), e);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io)?;
        f.write_all(text.as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(io)?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ca::parse(&text, &path),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| Error::Io(path.display().to_string(), e))?;
                Ca::parse(&text, &path)
            }
            Err(e) => Err(Error::Io(path.display().to_string(), e)),
        }
    }

    fn parse(text: &str, path: &Path) -> Result<Ca, Error> {
        let bad = |why: String| Error::Gateway(format!("{}: {why}", path.display()));
        let cert_der = CertificateDer::from_pem_slice(text.as_bytes())
            .map_err(|e| bad(format!("no CA certificate ({e})")))?;
        let start = text
            .find("-----BEGIN PRIVATE KEY-----")
            .ok_or_else(|| bad("no CA key".into()))?;
        let cert_pem = text[..start].trim().to_string() + "\n";
        let key = KeyPair::from_pem(&text[start..]).map_err(|e| bad(format!("CA key: {e}")))?;
        let issuer = Issuer::new(ca_params(&key), key);
        Ok(Ca {
            cert_pem,
            cert_der,
            issuer,
        })
    }

    /// The CA certificate (PEM): what the guest trusts.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A server certificate for `host` (a name or an address), and its key.
    fn leaf(
        &self,
        host: &str,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), Error> {
        let key = KeyPair::generate().map_err(tls_err("leaf key"))?;
        let mut p =
            CertificateParams::new(vec![host.to_string()]).map_err(tls_err("leaf certificate"))?;
        p.distinguished_name.push(DnType::CommonName, host);
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::days(1);
        p.not_after = now + time::Duration::days(LEAF_DAYS);
        p.use_authority_key_identifier_extension = true;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = p
            .signed_by(&key, &self.issuer)
            .map_err(tls_err("leaf certificate"))?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((vec![cert.der().clone(), self.cert_der.clone()], key))
    }
}

/// What the gateway needs to intercept: the CA (made on first use), the
/// server configurations per host, the client configuration.
pub struct Tls {
    paths: Paths,
    extra_roots: Option<PathBuf>,
    ca: OnceLock<Result<Arc<Ca>, String>>,
    servers: Mutex<HashMap<String, (Instant, Arc<rustls::ServerConfig>)>>,
    client: OnceLock<Result<Arc<rustls::ClientConfig>, String>>,
}

impl Tls {
    pub fn new(paths: &Paths, extra_roots: Option<PathBuf>) -> Self {
        Tls {
            paths: paths.clone(),
            extra_roots,
            ca: OnceLock::new(),
            servers: Mutex::new(HashMap::new()),
            client: OnceLock::new(),
        }
    }

    fn ca(&self) -> Result<Arc<Ca>, String> {
        self.ca
            .get_or_init(|| {
                Ca::load_or_create(&self.paths)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
    }

    /// The guest-facing configuration for `host` (its leaf, HTTP/1.1).
    pub fn server(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, String> {
        let mut m = self.servers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((made, c)) = m.get(host) {
            if made.elapsed() < LEAF_REFRESH {
                return Ok(c.clone());
            }
        }
        let (chain, key) = self.ca()?.leaf(host).map_err(|e| e.to_string())?;
        let mut c = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| format!("leaf certificate for {host}: {e}"))?;
        // The gateway speaks HTTP/1.1 only; a client that offers h2 too
        // falls back to it.
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        let c = Arc::new(c);
        m.insert(host.to_string(), (Instant::now(), c.clone()));
        Ok(c)
    }

    /// The destination-facing configuration: the host's roots (and the
    /// extra ones configured), HTTP/1.1.
    pub fn client(&self) -> Result<Arc<rustls::ClientConfig>, String> {
        self.client
            .get_or_init(|| client_config(self.extra_roots.as_deref()).map(Arc::new))
            .clone()
    }
}

/// The roots: the host's (rustls-native-certs: the system store, or what
/// SSL_CERT_FILE / SSL_CERT_DIR name) and `extra` (a PEM file).
fn client_config(extra: Option<&Path>) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _ignored) = roots.add_parsable_certificates(native.certs);
    let mut extra_n = 0;
    if let Some(p) = extra {
        for c in read_roots(p)? {
            roots
                .add(c)
                .map_err(|e| format!("{}: a root is not usable: {e}", p.display()))?;
            extra_n += 1;
        }
    }
    if added + extra_n == 0 {
        return Err(format!(
            "no trusted roots: the host has no CA certificates (install ca-certificates) and {EXTRA_ROOTS_ENV} names none"
        ));
    }
    let mut c = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(c)
}

/// The certificates of a PEM file (at least one).
pub fn read_roots(p: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(p)
        .map_err(|e| format!("{}: {e}", p.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", p.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in it", p.display()));
    }
    Ok(certs)
}

/// The home's CA certificate (PEM), made if there is none: what the wake
/// message carries to a guest whose contract intercepts HTTPS.
pub fn ca_cert_pem(paths: &Paths) -> Result<String, Error> {
    Ok(Ca::load_or_create(paths)?.cert_pem().to_string())
}

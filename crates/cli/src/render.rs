//! How the CLI shows what tined answered: one line per report, tables,
//! sizes and durations in one style.

use std::process::ExitCode;

/// A size in one style: the largest binary unit that keeps it at 1 or
/// more, one decimal below 10 (`512 KiB`, `8.3 MiB`, `1.2 GiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if v < 10.0 {
        format!("{v:.1} {}", UNITS[unit])
    } else {
        format!("{v:.0} {}", UNITS[unit])
    }
}

/// A time the user waited: ms below a second, else seconds.
pub fn human_ms(ms: f64) -> String {
    if ms < 1000.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{:.2} s", ms / 1000.0)
    }
}

/// An uptime: `42s`, `3m5s`, `2h10m`.
pub fn duration_s(s: u64) -> String {
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{}s", s / 60, s % 60),
        _ => format!("{}h{}m", s / 3600, (s % 3600) / 60),
    }
}

/// Prints what went wrong that did not stop the operation; exit 1 if
/// anything did.
pub fn problems(problems: &[String]) -> ExitCode {
    for p in problems {
        eprintln!("tine: {p}");
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("tine: {} step(s) failed (see above)", problems.len());
        ExitCode::FAILURE
    }
}

/// Prints `v` as JSON (pretty when `pretty`).
pub fn json(v: &impl serde::Serialize, pretty: bool) -> anyhow::Result<()> {
    if pretty {
        println!("{}", serde_json::to_string_pretty(v)?);
    } else {
        println!("{}", serde_json::to_string(v)?);
    }
    Ok(())
}

/// A progress bar on stderr for work that lasts more than a second (and
/// only on a terminal), fed from an operation's progress events.
pub struct Bar {
    bar: indicatif::ProgressBar,
    t0: std::time::Instant,
    shown: bool,
    what: String,
}

impl Bar {
    pub fn new() -> Bar {
        let bar = indicatif::ProgressBar::hidden();
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        Bar {
            bar,
            t0: std::time::Instant::now(),
            shown: false,
            what: String::new(),
        }
    }

    /// One progress event of an operation.
    pub fn update(&mut self, p: &crate::client::OpProgress) {
        use std::io::IsTerminal;
        if p.what != self.what {
            self.what = p.what.clone();
            self.bar.set_message(p.what.clone());
        }
        self.bar.set_length(p.total);
        self.bar.set_position(p.done);
        if !self.shown
            && self.t0.elapsed() > std::time::Duration::from_secs(1)
            && std::io::stderr().is_terminal()
        {
            self.shown = true;
            self.bar
                .set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
    }

    pub fn finish(&self) {
        if self.shown {
            self.bar.finish_and_clear();
        }
    }
}

/// One row of `tine ls`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct LsRow {
    pub name: String,
    /// running, stopped, crashed (vms); sleeping (branches); checkpoint.
    pub state: String,
    pub pid: Option<u32>,
    pub image: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    pub rss_mib: Option<u64>,
    pub uptime_s: Option<u64>,
    pub exit: Option<String>,
    #[serde(default)]
    pub parent: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_sizes_in_one_style() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(262_170 * 1024), "256 MiB");
        assert_eq!(human_bytes(8_700_000), "8.3 MiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(human_bytes(1024), "1.0 KiB");
    }

    #[test]
    fn test_durations() {
        assert_eq!(human_ms(12.34), "12.3 ms");
        assert_eq!(human_ms(1834.0), "1.83 s");
        assert_eq!(duration_s(185), "3m5s");
    }
}

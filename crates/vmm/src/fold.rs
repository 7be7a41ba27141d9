//! Folding a running vm's freed disk layers into its top layers
//! (`Request::FoldLayers`): the host names the frozen layers directly
//! under the vm's tops that no other chain uses; this checks them against
//! each disk's chain and says, per disk, how many layers to fold.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What folding did to one disk.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FoldReport {
    /// Index among the vm's disks.
    pub disk: usize,
    /// The layers folded into its top, top-most first (the host may
    /// delete them now).
    pub folded: Vec<PathBuf>,
    /// Bytes copied into the top.
    pub bytes_copied: u64,
    /// Layers in its chain now, top included.
    pub depth: usize,
    /// How long the fold took (the guest ran meanwhile).
    pub ms: f64,
}

/// Why layers cannot be folded.
#[derive(Debug, thiserror::Error)]
pub enum FoldError {
    #[error("{}: not a layer of any disk of this vm", .0.display())]
    NotInChain(PathBuf),
    #[error("{}: not directly below the top of disk {disk} (after {}: {} is next)", .layer.display(), .after.display(), .next.display())]
    NotDirectlyBelow {
        layer: PathBuf,
        disk: usize,
        after: PathBuf,
        next: PathBuf,
    },
    #[error("{}: the bottom layer of disk {disk} cannot be folded into its top", .0.display(), disk = .1)]
    Bottom(PathBuf, usize),
    #[error("{}: named twice", .0.display())]
    Twice(PathBuf),
    #[error("{}: the writable top of disk {disk}, not a frozen layer", .0.display(), disk = .1)]
    Top(PathBuf, usize),
    #[error("{}: named out of chain order for disk {disk} (name the layers top-most first)", .0.display(), disk = .1)]
    Order(PathBuf, usize),
    #[error("Cannot fold into disk {index}")]
    Disk {
        index: usize,
        #[source]
        source: disk::DiskError,
    },
    #[error("The vm has no writable disk to fold into")]
    NoDisk,
}

/// Per disk (index, chain paths top first), how many layers to fold: the
/// named layers of each chain must be exactly the ones directly below its
/// top, in chain order, and never its bottom; every named layer must be in
/// some chain.
pub fn plan(
    chains: &[(usize, Vec<PathBuf>)],
    layers: &[PathBuf],
) -> Result<Vec<(usize, usize)>, FoldError> {
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let named: Vec<PathBuf> = layers.iter().map(|p| canon(p)).collect();
    for (i, n) in named.iter().enumerate() {
        if named[..i].contains(n) {
            return Err(FoldError::Twice(layers[i].clone()));
        }
    }
    let mut used = vec![false; named.len()];
    let mut out = Vec::new();
    for (disk, chain) in chains {
        let chain: Vec<PathBuf> = chain.iter().map(|p| canon(p)).collect();
        if let Some(j) = chain
            .first()
            .and_then(|t| named.iter().position(|n| n == t))
        {
            return Err(FoldError::Top(layers[j].clone(), *disk));
        }
        // The run of named layers directly below the top, named in order.
        let mut k = 0;
        let mut last = None;
        while let Some(l) = chain.get(k + 1) {
            match named.iter().position(|n| n == l) {
                Some(j) => {
                    if last.is_some_and(|p| p > j) {
                        return Err(FoldError::Order(layers[j].clone(), *disk));
                    }
                    last = Some(j);
                    used[j] = true;
                    k += 1;
                }
                None => break,
            }
        }
        if k > 0 && k + 1 >= chain.len() {
            return Err(FoldError::Bottom(chain[k].clone(), *disk));
        }
        // A named layer deeper in this chain is not directly below.
        for l in chain.iter().skip(k + 2) {
            if let Some(j) = named.iter().position(|n| n == l) {
                return Err(FoldError::NotDirectlyBelow {
                    layer: layers[j].clone(),
                    disk: *disk,
                    after: chain[k].clone(),
                    next: chain[k + 1].clone(),
                });
            }
        }
        if k > 0 {
            out.push((*disk, k));
        }
    }
    if let Some(j) = used.iter().position(|u| !u) {
        return Err(FoldError::NotInChain(layers[j].clone()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(format!("/nonexistent/tine-fold/{s}"))
    }

    fn chains() -> Vec<(usize, Vec<PathBuf>)> {
        vec![
            (0, vec![p("t0"), p("a1"), p("a2"), p("a3"), p("base")]),
            (1, vec![p("t1"), p("b1"), p("base1")]),
        ]
    }

    #[test]
    fn test_plan_takes_the_run_directly_below_each_top() {
        let plan = plan(&chains(), &[p("a1"), p("a2"), p("b1")]).expect("plan");
        assert_eq!(plan, vec![(0, 2), (1, 1)]);
        assert_eq!(plan_of(&[p("b1")]), vec![(1, 1)]);
    }

    fn plan_of(l: &[PathBuf]) -> Vec<(usize, usize)> {
        plan(&chains(), l).expect("plan")
    }

    #[test]
    fn test_plan_refuses_what_is_not_directly_below_in_order() {
        let e = |l: &[PathBuf]| plan(&chains(), l).expect_err("refused").to_string();
        assert!(e(&[p("a2")]).contains("not directly below"));
        assert!(e(&[p("a1"), p("a3")]).contains("not directly below"));
        assert!(e(&[p("a2"), p("a1")]).contains("out of chain order"));
        assert!(e(&[p("a1"), p("a2"), p("a3"), p("base")]).contains("bottom"));
        assert!(e(&[p("b1"), p("base1")]).contains("bottom"));
        assert!(e(&[p("t0")]).contains("writable top"));
        assert!(e(&[p("zz")]).contains("not a layer"));
        assert!(e(&[p("a1"), p("a1")]).contains("twice"));
    }
}

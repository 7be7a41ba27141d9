//! Memory sizes as users write them: `512M`, `1G`, `64` (MiB); parsed the
//! same by the CLI, tined (host) and the VMM binary.

/// Parses a size into MiB.
pub fn parse_mib(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let unit = &s[i..];
            let num = s[..i].trim_end_matches(['i', 'I']);
            let mult = match unit.to_ascii_uppercase().as_str() {
                "M" => 1,
                "G" => 1024,
                "B" if num.ends_with(['M', 'm']) => return parse_mib(&num[..num.len() - 1]),
                "B" if num.ends_with(['G', 'g']) => {
                    return parse_mib(&format!("{}G", &num[..num.len() - 1]))
                }
                _ => return Err(format!("unknown unit in {s:?}; use M or G (e.g. 512M, 2G)")),
            };
            (num, mult)
        }
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size; use e.g. 512M or 2G"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_mib_units() {
        assert_eq!(parse_mib("512M"), Ok(512));
        assert_eq!(parse_mib("2G"), Ok(2048));
        assert_eq!(parse_mib("64"), Ok(64));
        assert_eq!(parse_mib("1GiB"), Ok(1024));
        assert!(parse_mib("12X").is_err());
        assert!(parse_mib("abc").is_err());
    }
}

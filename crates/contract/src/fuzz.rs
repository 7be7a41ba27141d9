//! The fuzz harness of the contract parser (fuzz/, `fuzzing` feature) and
//! its property tests. A contract arrives from users, API clients and
//! inside snapshot manifests: any text is parsed and validated or refused
//! with an error, and what is accepted survives its own TOML form.

use crate::Contract;

/// Parses `data` as a contract; an accepted one must print as TOML that
/// parses back to the same contract, and its queries must answer.
pub fn contract_toml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(c) = Contract::parse(text) else {
        return;
    };
    let again = Contract::parse(&c.to_toml()).expect("a valid contract's TOML parses");
    assert_eq!(again, c, "contract changed through its TOML form");
    let _ = c.clock();
    let _ = c.allow_rules().expect("validated");
    let _ = c.keeps_connections("parent");
    for (host, port) in [("api.example.com", 443), ("", 0), ("*", 80)] {
        let _ = c.effects.policy_for(host, port, false);
    }
    let _ = c.overridden_by(&Contract::default());
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn config() -> ProptestConfig {
        ProptestConfig {
            cases: 512,
            failure_persistence: None,
            ..ProptestConfig::default()
        }
    }

    /// TOML lines from the contract's own vocabulary, in any combination.
    fn line() -> impl Strategy<Value = String> {
        prop_oneof![
            "randomness = \"(secure|reproducible|x)\"",
            "clock = \"(host|virtual|y)\"",
            "\\[network\\]",
            "keep_connections = \"(parent|none|c1|)\"",
            "children_egress = \"(allow|deny|z)\"",
            "allow = \\[\"[0-9./:]{0,20}\"\\]",
            "\\[secrets\\.[a-z.]{0,6}\\]",
            "path = \"[/a-z.]{0,12}\"",
            "on_fork = \"(keep|revoke|rotate)\"",
            "provider = \"[/a-z ]{0,12}\"",
            "revoke_hook = \"[/a-z]{0,8}\"",
            "\\[hooks\\]",
            "run = (true|false)",
            "timeout_s = [0-9]{1,6}",
            "\\[effects\\]",
            "max_response_bytes = [0-9]{1,20}",
            "\\[effects\\.destinations\\]",
            "\"[*.a-z:0-9]{0,16}\" = \"(once-per-tree|per-branch|deny-in-children|pass|q)\"",
            "[ -~]{0,24}",
        ]
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn prop_contract_lines_parse_or_refuse(lines in proptest::collection::vec(line(), 0..12)) {
            contract_toml(lines.join("\n").as_bytes());
        }

        #[test]
        fn prop_contract_any_text(text in "\\PC{0,256}") {
            contract_toml(text.as_bytes());
        }
    }

    /// Lines from the vocabulary do reach accepted contracts (the property
    /// above is not only about refusals).
    #[test]
    fn test_vocabulary_reaches_valid_contracts() {
        let text = "randomness = \"reproducible\"\n[network]\nkeep_connections = \"none\"\nallow = [\"10.0.0.0/8:80\"]\n[effects.destinations]\n\"*.example.com:443\" = \"per-branch\"\n";
        contract_toml(text.as_bytes());
        assert!(Contract::parse(text).is_ok());
    }

    /// Every input under fuzz/regressions/contract_toml/ (failures found once).
    #[test]
    fn test_fuzz_regressions_replay() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/regressions/contract_toml");
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            contract_toml(&std::fs::read(e.path()).expect("regression input"));
        }
    }
}

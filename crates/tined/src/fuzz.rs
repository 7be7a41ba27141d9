//! The fuzz harness of the API's request bodies (fuzz/, `fuzzing` feature)
//! and its property tests: every JSON body type a route takes, parsed the
//! way the routes parse it ([`crate::state::parse_json`]), and E2B's
//! Connect envelopes. Any body is a typed value or a 400, never a panic.
//! schemathesis drives the same bodies through a running tined
//! (scripts/schemathesis).

use serde::de::DeserializeOwned;

use crate::state::parse_json;

fn parse<T: DeserializeOwned>(body: &[u8]) {
    let _ = parse_json::<T>(body);
}

/// Body types in the order the first input byte picks them.
const PARSERS: &[fn(&[u8])] = &[
    parse::<host::vm::RunSpec>,
    parse::<crate::app::StopSpec>,
    parse::<host::fork::ForkSpec>,
    parse::<crate::app::CheckpointSpec>,
    parse::<crate::app::RollbackSpec>,
    parse::<crate::app::SnapshotSpec>,
    parse::<crate::app::MoveSpec>,
    parse::<crate::app::ContractBody>,
    parse::<crate::app::SecretBody>,
    parse::<crate::app::ResolveSpec>,
    parse::<host::tree::WakeSpec>,
    parse::<crate::app::PrefetchSpec>,
    parse::<crate::images::BuildSpec>,
    parse::<crate::app::GatewayControl>,
    parse::<crate::app::NewKeySpec>,
    parse::<crate::keep::KeepSpec>,
    parse::<crate::agent_io::SignalSpec>,
    parse::<crate::agent_io::ExecSpec>,
    parse::<crate::agent_io::MoveSpec>,
    parse::<crate::agent_io::ConsoleLine>,
    crate::e2b::fuzz_body,
];

/// The first byte picks a body type, the rest is the body.
pub fn api_json(data: &[u8]) {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    PARSERS[usize::from(pick) % PARSERS.len()](body);
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// JSON-ish text: objects with the API's field names and values of
    /// every kind, so the parsers get past the first byte.
    fn json() -> impl Strategy<Value = String> {
        let key = prop_oneof![
            Just("name".to_string()),
            Just("children".to_string()),
            Just("mem_mib".to_string()),
            Just("vcpus".to_string()),
            Just("argv".to_string()),
            Just("timeout_ms".to_string()),
            Just("toml".to_string()),
            Just("image".to_string()),
            "[a-z_]{1,10}",
        ];
        let value = prop_oneof![
            Just("null".to_string()),
            Just("-1".to_string()),
            Just("18446744073709551616".to_string()),
            Just("1e309".to_string()),
            "[0-9]{1,12}",
            "\"[ -~]{0,16}\"",
            Just("[\"sh\",\"-c\",\"true\"]".to_string()),
            Just("{}".to_string()),
            Just("true".to_string()),
        ];
        proptest::collection::vec((key, value), 0..6).prop_map(|kv| {
            let fields: Vec<String> = kv.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            format!("{{{}}}", fields.join(","))
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1024, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn prop_api_bodies_parse_or_refuse(pick: u8, body in json()) {
            let mut data = vec![pick];
            data.extend_from_slice(body.as_bytes());
            api_json(&data);
        }

        #[test]
        fn prop_api_any_bytes(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            api_json(&data);
        }
    }

    /// Every input under fuzz/regressions/api_json/ (failures found once).
    #[test]
    fn test_fuzz_regressions_replay() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/regressions/api_json");
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            api_json(&std::fs::read(e.path()).expect("regression input"));
        }
    }
}

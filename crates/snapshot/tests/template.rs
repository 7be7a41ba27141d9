//! CPU templates: parsing and validation, applying one to a CPUID list,
//! whether a host satisfies one, and the restore check of a snapshot taken
//! under one.

use snapshot::compat::{
    check, required_features, Compat, CpuidBit, CpuidEntry, HostCompat, Mismatch, Register,
    CPUID_FLAG_SIGNIFICANT_INDEX,
};
use snapshot::template::{self, Template, TemplateError, TemplateRecord};

fn t2() -> Template {
    template::builtin("t2")
        .expect("t2 exists")
        .expect("t2 parses")
}

fn entry(function: u32, index: u32, regs: [u32; 4]) -> CpuidEntry {
    CpuidEntry {
        function,
        index,
        flags: if matches!(function, 0x7 | 0xd) {
            CPUID_FLAG_SIGNIFICANT_INDEX
        } else {
            0
        },
        eax: regs[0],
        ebx: regs[1],
        ecx: regs[2],
        edx: regs[3],
    }
}

fn get(cpuid: &[CpuidEntry], function: u32, index: u32, r: Register) -> u32 {
    let e = cpuid
        .iter()
        .find(|e| e.function == function && e.index == index)
        .expect("leaf");
    match r {
        Register::Eax => e.eax,
        Register::Ebx => e.ebx,
        Register::Ecx => e.ecx,
        Register::Edx => e.edx,
    }
}

fn set(cpuid: &mut [CpuidEntry], function: u32, index: u32, r: Register, f: impl Fn(u32) -> u32) {
    let e = cpuid
        .iter_mut()
        .find(|e| e.function == function && e.index == index)
        .expect("leaf");
    let v = match r {
        Register::Eax => &mut e.eax,
        Register::Ebx => &mut e.ebx,
        Register::Ecx => &mut e.ecx,
        Register::Edx => &mut e.edx,
    };
    *v = f(*v);
}

/// A rich AMD host (a Zen 4 like this machine): everything t2 needs and
/// much it hides (AVX-512, SHA, PCID, SSE4a, XSAVES, AVX-512 state).
fn rich_host() -> HostCompat {
    let cpuid = vec![
        // "AuthenticAMD"
        entry(0x0, 0, [0x10, 0x6874_7541, 0x444d_4163, 0x6974_6e65]),
        entry(0x1, 0, [0x00a1_0f11, 0x0000_0800, 0xfef8_3203, 0x178b_fbff]),
        entry(0x7, 0, [1, 0xf1bf_07ab, 0x005c_5f4e, 0x0000_0010]),
        entry(0x7, 1, [0x20, 0, 0, 0]),
        entry(0xd, 0, [0xe7, 0x988, 0x988, 0]),
        entry(0xd, 1, [0xf, 0x988, 0, 0]),
        entry(0x8000_0001, 0, [0x00a1_0f11, 0, 0x0000_0ff3, 0x2fd3_fbff]),
        entry(0x8000_0007, 0, [0, 0, 0, 0x100]),
        entry(0x8000_0008, 0, [0x3030, 0x0100_d205, 0, 0]),
    ];
    HostCompat {
        tine_version: "0.1.0".into(),
        format_version: snapshot::FORMAT_VERSION,
        kernel: "6.1.0".into(),
        cpu_vendor: "AuthenticAMD".into(),
        cpuid,
        msrs: vec![0x10, 0x48, 0x10a, 0x6e0],
        caps: vec![],
        tsc_khz: Some(2_400_000),
    }
}

/// What a vm started under `template` (if any) on `host` saves.
fn snapshot_on(host: &HostCompat, template: Option<&Template>) -> Compat {
    let mut cpuid = host.cpuid.clone();
    if let Some(t) = template {
        t.apply_cpuid(&mut cpuid);
    }
    Compat {
        tine_version: host.tine_version.clone(),
        format_version: host.format_version,
        host_kernel: host.kernel.clone(),
        cpu_vendor: host.cpu_vendor.clone(),
        cpuid,
        msrs: vec![0x10],
        caps: vec![],
        tsc_khz: host.tsc_khz,
        devices: vec![],
        mem_mib: 64,
        vcpus: 1,
        cpu_template: template.map(TemplateRecord::of),
    }
}

const AVX2: CpuidBit = CpuidBit {
    function: 0x7,
    index: 0,
    register: Register::Ebx,
    bit: 5,
};
const AVX512F: CpuidBit = CpuidBit {
    function: 0x7,
    index: 0,
    register: Register::Ebx,
    bit: 16,
};

fn invalid(json: &str) -> String {
    match Template::parse(json, "test") {
        Err(TemplateError::Invalid { what, .. }) => what,
        other => panic!("expected Invalid for {json}, got {other:?}"),
    }
}

#[test]
fn test_builtins_parse_and_roundtrip() {
    let all = template::builtins().expect("built-ins parse");
    let names: Vec<&str> = all.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, template::builtin_names());
    assert!(names.contains(&template::DEFAULT_TEMPLATE));
    for t in &all {
        assert!(!t.description.is_empty(), "{}", t.name);
        let back = Template::parse(&t.to_json(), "again").expect("own JSON parses");
        assert_eq!(&back, t);
        assert_eq!(back.hash(), t.hash());
        assert_eq!(t.hash().len(), 64);
    }
    assert_ne!(all[0].hash(), all[1].hash(), "t2 and t2s differ");
    // Case-insensitive, like Firecracker's "T2".
    assert_eq!(template::resolve("T2").expect("T2"), t2());

    // What t2 sets, bit by bit where it matters.
    let t = t2();
    let req = required_features(&t);
    assert_ne!(get(&req, 0x7, 0, Register::Ebx) & (1 << 5), 0, "avx2");
    assert_ne!(get(&req, 0x1, 0, Register::Ecx) & (1 << 20), 0, "sse4_2");
    let ebx7 = t.bitmap(0x7, 0, Register::Ebx).expect("leaf 7 EBX");
    for (bit, what) in [
        (4, "hle"),
        (11, "rtm"),
        (14, "mpx"),
        (16, "avx512f"),
        (29, "sha"),
    ] {
        assert_ne!(ebx7.mask & (1 << bit), 0, "{what} defined");
        assert_eq!(ebx7.value & (1 << bit), 0, "{what} hidden");
    }
    let xcr0 = t.bitmap(0xd, 0, Register::Eax).expect("leaf 0xd EAX");
    assert_eq!(
        (xcr0.mask & 0xff, xcr0.value),
        (0xff, 0x7),
        "x87, SSE, AVX state only"
    );
    // t2 passes speculation control through, t2s hides it.
    let spec = |t: &Template| t.bitmap(0x7, 0, Register::Edx).expect("7 EDX").mask & (1 << 26);
    assert_eq!(spec(&t), 0);
    let t2s = template::builtin("t2s").expect("t2s").expect("parses");
    assert_ne!(spec(&t2s), 0);
}

#[test]
fn test_hash_is_of_content_only() {
    let t = t2();
    let mut renamed = t.clone();
    renamed.name = "mine".into();
    renamed.description = "a copy".into();
    assert_eq!(renamed.hash(), t.hash());
    // Reformatted JSON, plain numbers for the leaves: the same content.
    let compact = serde_json::to_string(&t).expect("json");
    let numbers = compact.replace("\"leaf\":\"0x7\"", "\"leaf\":7");
    assert_ne!(numbers, compact);
    assert_eq!(
        Template::parse(&numbers, "n").expect("parses").hash(),
        t.hash()
    );
    let mut changed = t.clone();
    changed.cpuid_modifiers[0].modifiers[0].bitmap.mask ^= 1;
    assert_ne!(changed.hash(), t.hash());
}

#[test]
fn test_bad_templates_are_refused_clearly() {
    match Template::parse("{\"cpuid_modifiers\": [", "broken.json") {
        Err(e @ TemplateError::Json { .. }) => {
            assert!(e.to_string().contains("broken.json"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let what = invalid(r#"{"cpuid_modifier": []}"#);
    assert!(what.contains("unknown field `cpuid_modifier`"), "{what}");
    let leaf = |leaf: &str, reg: &str, bitmap: &str| {
        format!(
            r#"{{"cpuid_modifiers": [{{"leaf": {leaf}, "subleaf": "0x0", "flags": 0,
                "modifiers": [{{"register": "{reg}", "bitmap": "{bitmap}"}}]}}]}}"#
        )
    };
    let ok = "0bxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx1";
    Template::parse(&leaf("\"0x1\"", "ecx", ok), "ok").expect("valid");
    let what = invalid(&leaf("\"1x\"", "ecx", ok));
    assert!(what.contains("leaf \"1x\" is not a number"), "{what}");
    let what = invalid(&leaf("\"0x100000000\"", "ecx", ok));
    assert!(what.contains("does not fit in 32 bits"), "{what}");
    let what = invalid(&leaf("\"0x1\"", "exx", ok));
    assert!(
        what.contains("register \"exx\" is not one of eax, ebx, ecx, edx"),
        "{what}"
    );
    let what = invalid(&leaf("\"0x1\"", "ecx", "0b0101"));
    assert!(
        what.contains("has 4 characters after 0b; it needs exactly 32"),
        "{what}"
    );
    let what = invalid(&leaf(
        "\"0x1\"",
        "ecx",
        "0bxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx2",
    ));
    assert!(what.contains("'2' for bit 0; use 0, 1 or x"), "{what}");
    let what = invalid(&leaf("\"0x1\"", "ecx", "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"));
    assert!(what.contains("must start with 0b"), "{what}");
    assert!(what.contains("leaf 0x1, subleaf 0x0"), "{what}");
    let what = invalid(&format!(
        r#"{{"cpuid_modifiers": [{{"leaf": "0x1", "modifiers": [
            {{"register": "ecx", "bitmap": "{ok}"}}, {{"register": "ECX", "bitmap": "{ok}"}}]}}]}}"#
    ));
    assert!(what.contains("register ECX is modified twice"), "{what}");
    let one = format!(
        r#"{{"leaf": "0x1", "subleaf": "0x0", "modifiers": [{{"register": "ecx", "bitmap": "{ok}"}}]}}"#
    );
    let what = invalid(&format!(r#"{{"cpuid_modifiers": [{one}, {one}]}}"#));
    assert!(what.contains("appear twice"), "{what}");
    let what = invalid(
        r#"{"cpuid_modifiers": [{"leaf": "0x1", "flags": 4, "modifiers": [{"register": "eax", "bitmap": "0bxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}]}]}"#,
    );
    assert!(what.contains("flags 0x4"), "{what}");
    let what = invalid(r#"{"msr_modifiers": [{"addr": "0x10a", "bitmap": "0b0"}]}"#);
    assert!(
        what.contains("MSR 0x10a") && what.contains("exactly 64"),
        "{what}"
    );
    let what = invalid(r#"{"name": "no spaces allowed"}"#);
    assert!(what.contains("name \"no spaces allowed\""), "{what}");

    let e = template::resolve("t3").expect_err("no such template");
    assert!(matches!(e, TemplateError::Unknown(_)));
    assert!(e.to_string().contains("built-in template (t2, t2s)"), "{e}");
    let e = template::resolve("/nonexistent/mine.json").expect_err("no file");
    assert!(matches!(e, TemplateError::Read { .. }), "{e}");
}

#[test]
fn test_custom_template_from_file() {
    let dir = std::env::temp_dir().join(format!("tine-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("no-avx2.json");
    // t2 without AVX2, as a user would write it: t2's JSON, edited.
    let mut json: serde_json::Value = serde_json::from_str(&t2().to_json()).expect("json");
    if let Some(o) = json.as_object_mut() {
        o.remove("name");
        o.insert(
            "msr_modifiers".into(),
            serde_json::json!([{"addr": "0x10a", "bitmap": format!("0b{}", "0".repeat(64))}]),
        );
    }
    let text = serde_json::to_string_pretty(&json).expect("json").replace(
        "0b00000000100110000000000110101001",
        "0b00000000100110000000000110001001",
    );
    std::fs::write(&path, text).expect("write");
    let t = template::resolve(path.to_str().expect("utf-8")).expect("custom template");
    assert_eq!(t.name, "no-avx2", "named after the file");
    assert_eq!(t.msr_modifiers.len(), 1);
    assert_eq!(t.msr_modifiers[0].bitmap.mask, u64::MAX);
    let ebx = t.bitmap(0x7, 0, Register::Ebx).expect("7 EBX");
    assert_eq!(ebx.value & (1 << 5), 0, "avx2 hidden");
    assert_ne!(t.hash(), t2().hash());
    // Its MSR must be listed by the host's KVM.
    let mut host = rich_host();
    host.satisfies(&t).expect("rich host");
    host.msrs.retain(|&m| m != 0x10a);
    let gaps = host.satisfies(&t).expect_err("no 0x10a");
    assert_eq!(
        gaps,
        vec![Mismatch::TemplateMsr {
            template: "no-avx2".into(),
            index: 0x10a
        }]
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn test_apply_sets_defined_bits_and_keeps_the_rest() {
    let host = rich_host();
    let t = t2();
    let mut cpuid = host.cpuid.clone();
    cpuid.retain(|e| e.function != 0x7 || e.index != 1);
    t.apply_cpuid(&mut cpuid);
    // The guest sees exactly t2's bits where t2 defines them.
    assert_eq!(t.differences(&cpuid), Vec::<CpuidBit>::new());
    let ebx7 = get(&cpuid, 0x7, 0, Register::Ebx);
    assert_ne!(ebx7 & (1 << 5), 0, "avx2 kept");
    assert_eq!(ebx7 & (1 << 16), 0, "avx512f hidden");
    assert_eq!(
        get(&cpuid, 0xd, 0, Register::Eax),
        0x7,
        "XCR0: x87, SSE, AVX"
    );
    // Bits t2 leaves to the host pass through (family/model in leaf 1
    // EAX, invariant TSC), and so does what the vCPU sets itself.
    assert_eq!(get(&cpuid, 0x1, 0, Register::Eax), 0x00a1_0f11);
    assert_eq!(get(&cpuid, 0x8000_0007, 0, Register::Edx), 0x100);
    assert_eq!(get(&cpuid, 0x1, 0, Register::Ebx), 0x0000_0800);
    // A leaf the host list lacked is added with the template's bits.
    let added = cpuid
        .iter()
        .find(|e| e.function == 0x7 && e.index == 1)
        .expect("7.1 added");
    assert_eq!((added.eax, added.flags), (0, CPUID_FLAG_SIGNIFICANT_INDEX));
    // A vCPU whose KVM dropped or added a defined bit is told apart, but
    // not for the bits tine sets per vCPU (APIC ID, HYPERVISOR).
    set(&mut cpuid, 0x1, 0, Register::Ebx, |v| v | 0x0102_0000);
    set(&mut cpuid, 0x1, 0, Register::Ecx, |v| v | (1 << 31));
    assert_eq!(t.differences(&cpuid), Vec::<CpuidBit>::new());
    set(&mut cpuid, 0x7, 0, Register::Ebx, |v| {
        (v & !(1 << 5)) | (1 << 16)
    });
    assert_eq!(t.differences(&cpuid), vec![AVX2, AVX512F]);
}

#[test]
fn test_host_satisfies_template() {
    let t = t2();
    let mut host = rich_host();
    host.satisfies(&t).expect("a richer host than t2");
    assert_eq!(host.satisfied_templates(), vec!["t2", "t2s"]);
    // Take away avx2 (and sse4_2): refused, each named.
    set(&mut host.cpuid, 0x7, 0, Register::Ebx, |v| v & !(1 << 5));
    set(&mut host.cpuid, 0x1, 0, Register::Ecx, |v| v & !(1 << 20));
    let gaps = host.satisfies(&t).expect_err("no avx2");
    let text: Vec<String> = gaps.iter().map(ToString::to_string).collect();
    assert_eq!(gaps.len(), 2, "{text:?}");
    assert!(matches!(
        &gaps[1],
        Mismatch::TemplateFeature { template, name: Some("avx2"), bit } if template == "t2" && *bit == AVX2
    ));
    assert!(
        text[1].starts_with(
            "CPU feature avx2 (CPUID.(EAX=0x7,ECX=0):EBX bit 5): CPU template t2 requires it"
        ),
        "{text:?}"
    );
    assert!(text[0].starts_with("CPU feature sse4_2"), "{text:?}");
    assert!(host.satisfied_templates().is_empty());
    // A host without leaf 7 at all lacks all of it.
    host.cpuid.retain(|e| e.function != 0x7);
    assert!(host.satisfies(&t).expect_err("no leaf 7").len() > 5);
}

#[test]
fn test_restore_under_a_template_checks_the_template() {
    let t = t2();
    let first = rich_host();
    let saved = snapshot_on(&first, Some(&t));
    check(&saved, &first).expect("its own host");
    // Another host with t2's features but none of the rich extras the
    // first had (AVX-512, SHA, ...): the templated snapshot moves...
    let mut second = first.clone();
    second.cpuid = required_features(&t);
    second.cpuid.push(first.cpuid[0]);
    // ... but keeping the bits t2 passes through that the guest saw
    // (invariant TSC, speculation control).
    for (f, i, r) in [
        (0x8000_0007, 0, Register::Edx),
        (0x8000_0008, 0, Register::Ebx),
        (0x7, 0, Register::Edx),
    ] {
        let v = get(&saved.cpuid, f, i, r);
        if !second.cpuid.iter().any(|e| e.function == f && e.index == i) {
            second.cpuid.push(entry(f, i, [0; 4]));
        }
        set(&mut second.cpuid, f, i, r, |x| x | v);
    }
    if let Err(e) = check(&saved, &second) {
        panic!("a host satisfying t2 refused a t2 snapshot:\n{e}");
    }
    // The same vm without a template saw the first host's AVX-512: the
    // second host refuses it, as before templates, and says which
    // template would have made it move.
    let plain = snapshot_on(&first, None);
    let err = check(&plain, &second).expect_err("no template: full feature set");
    assert!(err.mismatches.contains(&Mismatch::CpuFeature {
        name: Some("avx512f"),
        bit: AVX512F
    }));
    let text = err.to_string();
    assert!(
        text.contains("take the snapshot under a CPU template this host satisfies (t2, t2s: tine run --cpu-template t2)"),
        "{text}"
    );
    // A host missing a feature t2 needs: refused naming the feature and
    // the template.
    let mut third = second.clone();
    set(&mut third.cpuid, 0x7, 0, Register::Ebx, |v| v & !(1 << 5));
    let err = check(&saved, &third).expect_err("no avx2");
    assert_eq!(
        err.mismatches,
        vec![Mismatch::TemplateFeature {
            template: "t2".into(),
            name: Some("avx2"),
            bit: AVX2
        }]
    );
    let text = err.to_string();
    assert!(text.contains("CPU feature avx2"), "{text}");
    assert!(
        text.contains("restore on a host that satisfies CPU template t2"),
        "{text}"
    );
    assert!(!text.contains("take the snapshot under"), "{text}");
    println!("{text}");
    // Without a template, a host that satisfies none says so.
    let err = check(&plain, &third).expect_err("no avx2 either");
    let text = err.to_string();
    assert!(
        text.contains("no built-in CPU template fits this host (t2, t2s need features it lacks)"),
        "{text}"
    );
}

#[test]
fn test_manifest_without_template_is_read_as_before() {
    let host = rich_host();
    let plain = snapshot_on(&host, None);
    let json = serde_json::to_string(&plain).expect("encode");
    assert!(!json.contains("cpu_template"), "absent, not null: {json}");
    let back: Compat = serde_json::from_str(&json).expect("decode");
    assert_eq!(back, plain);

    let under = snapshot_on(&host, Some(&t2()));
    let json = serde_json::to_string(&under).expect("encode");
    let back: Compat = serde_json::from_str(&json).expect("decode");
    assert_eq!(back, under);
    let rec = back.cpu_template.as_ref().expect("recorded");
    assert_eq!((rec.name.as_str(), rec.hash.clone()), ("t2", t2().hash()));

    // A manifest whose template was edited after the fact is refused.
    let mut altered = under.clone();
    if let Some(rec) = altered.cpu_template.as_mut() {
        rec.template.cpuid_modifiers[1].modifiers[0].bitmap.mask &= !(1 << 16);
    }
    let err = check(&altered, &host).expect_err("hash differs");
    assert!(
        matches!(&err.mismatches[0], Mismatch::TemplateHash { template, .. } if template == "t2"),
        "{err}"
    );
}

//! The compatibility check: each rule, and every mismatch named at once.

use snapshot::compat::{
    check, check_restore, merge_features, Compat, CpuidBit, CpuidEntry, HostCompat, KvmCap,
    Mismatch, Register, RestoreRequest, CAP_TSC_CONTROL, CPUID_FLAG_SIGNIFICANT_INDEX,
};
use Register::{Eax, Ebx, Ecx, Edx};

fn entry(function: u32, index: u32, regs: [u32; 4]) -> CpuidEntry {
    CpuidEntry {
        function,
        index,
        flags: if function == 0x7 || function == 0xd {
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

fn cap(name: &str, number: u32) -> KvmCap {
    KvmCap {
        name: name.into(),
        number,
    }
}

/// A host and a snapshot taken on it: the check passes.
fn pair() -> (Compat, HostCompat) {
    let cpuid = vec![
        // "GenuineIntel" in EBX, EDX, ECX.
        entry(0x0, 0, [0xd, 0x756e_6547, 0x6c65_746e, 0x4965_6e69]),
        entry(0x1, 0, [0x806f8, 0, 0x7ffa_3223, 0x0f8b_fbff]),
        entry(0x7, 0, [2, 0xf1bf_07ab, 0x1b40_5f6e, 0xa3c1_4010]),
        entry(0x7, 1, [0x30, 0, 0, 0]),
        entry(0xd, 0, [0x602e7, 0xa88, 0x2b00, 0]),
        entry(0xd, 1, [0xf, 0x3c0, 0, 0]),
        entry(0x8000_0001, 0, [0, 0, 0x121, 0x2c10_0800]),
    ];
    let caps = vec![cap("KVM_CAP_IRQCHIP", 0), cap("KVM_CAP_XCRS", 56)];
    let host = HostCompat {
        tine_version: "0.1.0".into(),
        format_version: snapshot::FORMAT_VERSION,
        kernel: "6.1.0".into(),
        cpu_vendor: "GenuineIntel".into(),
        cpuid: cpuid.clone(),
        msrs: vec![0x10, 0x48, 0x6e0, 0xc000_0080],
        caps: caps.clone(),
        tsc_khz: Some(2_400_000),
    };
    let saved = Compat {
        tine_version: "0.1.0".into(),
        format_version: snapshot::FORMAT_VERSION,
        host_kernel: "6.1.0".into(),
        cpu_vendor: "GenuineIntel".into(),
        cpuid,
        msrs: vec![0x10, 0x48, 0x6e0],
        caps,
        tsc_khz: Some(2_400_100),
        devices: vec!["virtio-blk".into(), "virtio-net".into()],
        mem_mib: 256,
        vcpus: 2,
        cpu_template: None,
    };
    (saved, host)
}

fn mismatches(saved: &Compat, host: &HostCompat) -> Vec<Mismatch> {
    check(saved, host).expect_err("must refuse").mismatches
}

fn reg(cpuid: &mut [CpuidEntry], function: u32, index: u32, r: Register) -> &mut u32 {
    let e = cpuid
        .iter_mut()
        .find(|e| e.function == function && e.index == index)
        .expect("leaf");
    match r {
        Eax => &mut e.eax,
        Ebx => &mut e.ebx,
        Ecx => &mut e.ecx,
        Edx => &mut e.edx,
    }
}

fn set_bit(cpuid: &mut [CpuidEntry], function: u32, index: u32, r: Register, bit: u32) {
    *reg(cpuid, function, index, r) |= 1 << bit;
}

fn clear_bit(cpuid: &mut [CpuidEntry], function: u32, index: u32, r: Register, bit: u32) {
    *reg(cpuid, function, index, r) &= !(1 << bit);
}

#[test]
fn test_same_host_passes() {
    let (saved, host) = pair();
    check(&saved, &host).expect("compatible");
    let request = RestoreRequest {
        devices: Some(saved.devices.clone()),
        mem_mib: Some(256),
        vcpus: Some(2),
    };
    check_restore(&saved, &host, &request).expect("same request");
}

#[test]
fn test_format_version_follows_the_read_rule() {
    let (mut saved, host) = pair();
    let v = snapshot::FORMAT_VERSION;
    // An older minor of the same major is read.
    if v.minor > 0 {
        saved.format_version = snapshot::Version::new(v.major, v.minor - 1);
        check(&saved, &host).expect("older minor");
    }
    saved.format_version = snapshot::Version::new(v.major - 1, v.minor);
    assert!(check(&saved, &host).is_err(), "an older major is refused");
    saved.format_version = snapshot::Version::new(v.major, v.minor + 1);
    saved.tine_version = "9.9.9".into();
    let m = mismatches(&saved, &host);
    assert!(
        matches!(m.as_slice(), [Mismatch::FormatVersion { .. }]),
        "{m:?}"
    );
    let text = check(&saved, &host).expect_err("refused").to_string();
    assert!(text.contains("tine 9.9.9"), "{text}");
}

#[test]
fn test_vendor_must_equal() {
    let (saved, mut host) = pair();
    host.cpu_vendor = "AuthenticAMD".into();
    assert_eq!(
        mismatches(&saved, &host),
        vec![Mismatch::Vendor {
            snapshot: "GenuineIntel".into(),
            host: "AuthenticAMD".into()
        }]
    );
}

#[test]
fn test_missing_feature_is_named() {
    let (saved, mut host) = pair();
    // avx512f: CPUID.(EAX=7,ECX=0):EBX bit 16.
    clear_bit(&mut host.cpuid, 0x7, 0, Ebx, 16);
    let err = check(&saved, &host).expect_err("refused");
    assert_eq!(
        err.mismatches,
        vec![Mismatch::CpuFeature {
            name: Some("avx512f"),
            bit: CpuidBit {
                function: 7,
                index: 0,
                register: Ebx,
                bit: 16
            }
        }]
    );
    let text = err.to_string();
    assert!(text.contains("CPU feature avx512f"), "{text}");
    assert!(text.contains("CPU template"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("  * ")).count(), 1);
}

#[test]
fn test_unnamed_feature_shows_the_bit() {
    let (mut saved, host) = pair();
    // A reserved bit the table has no name for.
    set_bit(&mut saved.cpuid, 0x7, 1, Eax, 30);
    let text = check(&saved, &host).expect_err("refused").to_string();
    assert!(text.contains("CPUID.(EAX=0x7,ECX=1):EAX bit 30"), "{text}");
}

#[test]
fn test_features_in_every_checked_leaf() {
    for (function, index, r, bit, name) in [
        (0x1, 0, Ecx, 20, "sse4_2"),
        (0x1, 0, Edx, 26, "sse2"),
        (0x7, 0, Ecx, 9, "vaes"),
        (0x7, 0, Edx, 14, "serialize"),
        (0x7, 1, Eax, 4, "avx_vnni"),
        (0xd, 0, Eax, 7, "xsave state avx512 hi16_zmm"),
        (0xd, 1, Eax, 3, "xsaves"),
        (0x8000_0001, 0, Ecx, 5, "abm"),
        (0x8000_0001, 0, Edx, 29, "lm"),
        (0x8000_0001, 0, Edx, 26, "pdpe1gb (1 GiB pages)"),
    ] {
        let (mut saved, mut host) = pair();
        set_bit(&mut saved.cpuid, function, index, r, bit);
        clear_bit(&mut host.cpuid, function, index, r, bit);
        let m = mismatches(&saved, &host);
        assert!(
            matches!(m.as_slice(), [Mismatch::CpuFeature { name: Some(n), .. }] if *n == name),
            "{name}: {m:?}"
        );
    }
}

#[test]
fn test_host_without_the_leaf_offers_nothing() {
    let (saved, mut host) = pair();
    host.cpuid.retain(|e| !(e.function == 0x7 && e.index == 1));
    // The guest saw avx_vnni and avx512_bf16 in 7.1 EAX (0x30).
    let names: Vec<_> = mismatches(&saved, &host)
        .iter()
        .map(|m| match m {
            Mismatch::CpuFeature { name, .. } => name.unwrap_or("?"),
            _ => "other",
        })
        .collect();
    assert_eq!(names, vec!["avx_vnni", "avx512_bf16"]);
}

#[test]
fn test_os_and_vmm_bits_are_not_host_features() {
    let (mut saved, mut host) = pair();
    set_bit(&mut saved.cpuid, 0x1, 0, Ecx, 27); // OSXSAVE
    set_bit(&mut saved.cpuid, 0x1, 0, Ecx, 31); // hypervisor
    set_bit(&mut saved.cpuid, 0x1, 0, Edx, 28); // HTT
    set_bit(&mut saved.cpuid, 0x7, 0, Ecx, 4); // OSPKE
    clear_bit(&mut host.cpuid, 0x1, 0, Ecx, 27);
    clear_bit(&mut host.cpuid, 0x1, 0, Ecx, 31);
    clear_bit(&mut host.cpuid, 0x1, 0, Edx, 28);
    clear_bit(&mut host.cpuid, 0x7, 0, Ecx, 4);
    check(&saved, &host).expect("compatible");
}

#[test]
fn test_saved_msr_must_be_listed() {
    let (saved, mut host) = pair();
    host.msrs.retain(|&i| i != 0x48);
    let err = check(&saved, &host).expect_err("refused");
    assert_eq!(err.mismatches, vec![Mismatch::Msr { index: 0x48 }]);
    let text = err.to_string();
    assert!(text.contains("MSR 0x48 (IA32_SPEC_CTRL)"), "{text}");
    assert!(text.contains("Linux 6.1.0"), "{text}");
}

#[test]
fn test_needed_cap_must_be_present() {
    let (saved, mut host) = pair();
    host.caps.retain(|c| c.number != 56);
    assert_eq!(
        mismatches(&saved, &host),
        vec![Mismatch::Cap(cap("KVM_CAP_XCRS", 56))]
    );
}

#[test]
fn test_tsc_rate_must_match_unless_the_host_scales_it() {
    let (mut saved, mut host) = pair();
    // 2_400_100 vs 2_400_000 kHz is within 250 ppm: passed above.
    saved.tsc_khz = Some(2_000_000);
    let err = check(&saved, &host).expect_err("other rate, no TSC control");
    assert_eq!(
        err.mismatches,
        vec![Mismatch::TscFrequency {
            snapshot: 2_000_000,
            host: 2_400_000
        }]
    );
    assert!(err.to_string().contains("KVM_CAP_TSC_CONTROL"), "{err}");
    host.caps.push(cap("KVM_CAP_TSC_CONTROL", CAP_TSC_CONTROL));
    check(&saved, &host).expect("the host scales the TSC");
    host.caps.pop();
    host.tsc_khz = None;
    check(&saved, &host).expect("host rate unknown: nothing to compare");
}

#[test]
fn test_request_compared_only_when_given() {
    let (saved, host) = pair();
    let request = RestoreRequest {
        devices: Some(vec!["virtio-blk".into()]),
        mem_mib: Some(512),
        vcpus: Some(4),
    };
    let err = check_restore(&saved, &host, &request).expect_err("refused");
    assert_eq!(
        err.mismatches,
        vec![
            Mismatch::Devices {
                snapshot: saved.devices.clone(),
                requested: vec!["virtio-blk".into()]
            },
            Mismatch::Memory {
                snapshot: 256,
                requested: 512
            },
            Mismatch::Vcpus {
                snapshot: 2,
                requested: 4
            },
        ]
    );
    let request = RestoreRequest {
        mem_mib: Some(256),
        ..Default::default()
    };
    check_restore(&saved, &host, &request).expect("only memory given, and equal");
}

#[test]
fn test_several_mismatches_are_all_named() {
    let (mut saved, mut host) = pair();
    saved.format_version.minor += 1;
    host.cpu_vendor = "AuthenticAMD".into();
    clear_bit(&mut host.cpuid, 0x7, 0, Ebx, 5); // avx2
    clear_bit(&mut host.cpuid, 0x1, 0, Ecx, 30); // rdrand
    host.msrs.clear();
    host.caps.clear();
    let err = check_restore(
        &saved,
        &host,
        &RestoreRequest {
            vcpus: Some(1),
            ..Default::default()
        },
    )
    .expect_err("refused");
    // Format, vendor, rdrand, avx2, 3 MSRs, 2 caps, vCPUs.
    assert_eq!(err.mismatches.len(), 10, "{:?}", err.mismatches);
    let text = err.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].contains("10 mismatches"), "{text}");
    assert_eq!(lines.iter().filter(|l| l.starts_with("  - ")).count(), 10);
    for needle in [
        "state format",
        "CPU vendor: the snapshot needs GenuineIntel; this host has AuthenticAMD",
        "CPU feature rdrand",
        "CPU feature avx2",
        "MSR 0x10 (IA32_TSC)",
        "MSR 0x48 (IA32_SPEC_CTRL)",
        "MSR 0x6e0 (IA32_TSC_DEADLINE)",
        "KVM capability KVM_CAP_IRQCHIP (0)",
        "KVM capability KVM_CAP_XCRS (56)",
        "vCPUs: the snapshot has 2; the restore asks for 1",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    // One piece of advice per kind of mismatch, after the list.
    let advice = &lines[11..];
    assert_eq!(advice[0], "What to do:", "{text}");
    assert_eq!(advice.len(), 5, "{text}");
    for (line, needle) in advice[1..].iter().zip([
        "tine 0.1.0",
        "CPU template",
        "Linux 6.1.0",
        "without overriding",
    ]) {
        assert!(
            line.starts_with("  * ") && line.contains(needle),
            "{needle:?} in\n{text}"
        );
    }
    println!("{text}");
}

#[test]
fn test_merge_features_adds_feature_bits_only() {
    let (saved, mut host) = pair();
    clear_bit(&mut host.cpuid, 0x7, 0, Ebx, 16); // avx512f
    host.cpuid.retain(|e| !(e.function == 0x7 && e.index == 1));
    check(&saved, &host).expect_err("host lacks avx512f and leaf 7.1");
    let mut effective = saved.cpuid.clone();
    // A size register (0xd.0 EBX) is not a feature: it must not be ORed.
    *reg(&mut effective, 0xd, 0, Ebx) = 0x0f0f;
    let size_before = *reg(&mut host.cpuid, 0xd, 0, Ebx);
    merge_features(&mut host.cpuid, &effective);
    check(&saved, &host).expect("merged features cover the guest");
    assert_eq!(*reg(&mut host.cpuid, 0xd, 0, Ebx), size_before);
    let added = host
        .cpuid
        .iter()
        .find(|e| e.function == 0x7 && e.index == 1)
        .expect("leaf 7.1 added");
    assert_eq!(
        (added.eax, added.flags),
        (0x30, CPUID_FLAG_SIGNIFICANT_INDEX)
    );
}

#[test]
fn test_compat_serde_roundtrip() {
    let (saved, host) = pair();
    let json = serde_json::to_string(&saved).expect("encode");
    let back: Compat = serde_json::from_str(&json).expect("decode");
    assert_eq!(back, saved);
    let json = serde_json::to_string(&host).expect("encode");
    let back: HostCompat = serde_json::from_str(&json).expect("decode");
    assert_eq!(back, host);
}

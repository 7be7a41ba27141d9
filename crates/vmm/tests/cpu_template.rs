//! CPU templates on real KVM (docs/design/cpu-templates.md): the `cpuid`
//! micro guest booted under `t2` sees t2's CPUID, both as KVM holds it for
//! the vCPU (KVM_GET_CPUID2, the probe) and as the guest's own CPUID
//! instruction answers; its snapshot records the template and restores
//! (the restored guest sees the same); the check of a templated snapshot
//! against an edited host offer asks for the template's features only.

mod micro;

use std::path::Path;
use std::time::{Duration, Instant};

use micro::{config, scratch, Console, VmmProcess};
use snapshot::compat::{check, feature_name, CpuidBit, CpuidEntry, HostCompat, Mismatch, Register};
use snapshot::template::{self, Template};
use vmm::api::Request;
use vmm::compat::{host_compat, snapshot_compat};
use vmm::VmConfig;

const KVM: &str = "/dev/kvm";

/// The leaves t2 sets (and a few it does not), as (leaf, subleaf).
const LEAVES: &[(u32, u32)] = &[
    (0x0, 0),
    (0x1, 0),
    (0x7, 0),
    (0x7, 1),
    (0xd, 0),
    (0xd, 1),
    (0x8000_0001, 0),
    (0x8000_0007, 0),
    (0x8000_0008, 0),
];

fn t2() -> Template {
    template::builtin("t2").expect("t2").expect("t2 parses")
}

/// What the guest's own CPUID instruction answers for [`LEAVES`].
fn guest_cpuid(c: &Console) -> Vec<CpuidEntry> {
    let mut out = Vec::new();
    for (n, &(leaf, sub)) in LEAVES.iter().enumerate() {
        let before = c.lines().iter().filter(|l| l.starts_with("CPUID ")).count();
        let line = c.command(&format!("cpuid {leaf} {sub}"), "CPUID ", before + 1);
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words.len(), 7, "{line} (command {n})");
        assert_eq!(
            (words[1], words[2]),
            (leaf.to_string().as_str(), sub.to_string().as_str()),
            "{line}"
        );
        let reg = |i: usize| {
            u32::try_from(u64::from_str_radix(words[i], 16).expect("hex")).expect("32 bits")
        };
        out.push(CpuidEntry {
            function: leaf,
            index: sub,
            flags: 1,
            eax: reg(3),
            ebx: reg(4),
            ecx: reg(5),
            edx: reg(6),
        });
    }
    out
}

/// Whether /dev/kvm is kvm_pvm (ENVIRONMENT.md).
fn pvm() -> bool {
    Path::new("/sys/module/kvm_pvm").exists()
}

/// `cpuid` has every bit `t` defines as `t` defines it. kvm_pvm passes
/// some of the hardware's bits through whatever the VMM sets (leaves 7 and
/// 0xD, since its guests run with the host's XCR0, and VME): there, bits
/// the template hides may show, but only bits this host offers, and
/// nothing the template requires may be missing.
fn matches_template(t: &Template, cpuid: &[CpuidEntry], what: &str) {
    let wrong = t.differences(cpuid);
    if wrong.is_empty() {
        return;
    }
    assert!(
        pvm(),
        "{what} differs from {} in {:?}",
        t.name,
        names(&wrong)
    );
    let host = host_compat(Path::new(KVM)).expect("host compat");
    let get = |list: &[CpuidEntry], b: &CpuidBit| {
        list.iter()
            .find(|e| e.matches(b.function, b.index))
            .map_or(0, |e| match b.register {
                Register::Eax => e.eax,
                Register::Ebx => e.ebx,
                Register::Ecx => e.ecx,
                Register::Edx => e.edx,
            })
            & (1 << b.bit)
    };
    for b in &wrong {
        assert!(
            get(cpuid, b) != 0 && get(&host.cpuid, b) != 0,
            "{what}: {} is not the template's, and not a host bit kvm_pvm passes through",
            names(&[*b])[0]
        );
    }
    println!(
        "{what}: kvm_pvm passes through {} bit(s) {} hides: {:?}",
        wrong.len(),
        t.name,
        names(&wrong)
    );
}

fn names(bits: &[CpuidBit]) -> Vec<String> {
    bits.iter()
        .map(|&b| match feature_name(b) {
            Some(n) => format!("{n} ({b})"),
            None => b.to_string(),
        })
        .collect()
}

/// Boots `kernel` in this process (under `template`), lets it start,
/// pauses and saves it: the vCPU's CPUID as KVM holds it (the probe) and
/// the manifest's compatibility set.
fn probe(template: Option<Template>) -> (Vec<CpuidEntry>, snapshot::compat::Compat, HostCompat) {
    let (cpuid, compat, host, _) = probe_machine(template);
    (cpuid, compat, host)
}

/// [`probe`], with the saved machine state.
fn probe_machine(
    template: Option<Template>,
) -> (
    Vec<CpuidEntry>,
    snapshot::compat::Compat,
    HostCompat,
    vmm::MachineState,
) {
    let dir = scratch(
        "cputpl",
        if template.is_some() {
            "probe-t"
        } else {
            "probe"
        },
    );
    let log = dir.join("console.log");
    let config = VmConfig {
        kernel: guests::counter_path().into(),
        cmdline: "mib=0".into(),
        mem_mib: 64,
        vcpus: 1,
        console_log: Some(log.clone()),
        cpu_template: template.clone(),
        ..Default::default()
    };
    let running = vmm::build(&config).expect("build").start().expect("start");
    let h = running.handle();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("CNT ")
    {
        assert!(Instant::now() < deadline, "counter printed nothing");
        std::thread::sleep(Duration::from_millis(10));
    }
    h.pause().expect("pause");
    let machine = h.save_state().expect("save state");
    h.stop();
    let _ = std::fs::remove_dir_all(dir);
    let host = host_compat(Path::new(KVM)).expect("host compat");
    let mut compat = snapshot_compat(&machine, Vec::new(), 64, &host);
    compat.cpu_template = template.as_ref().map(template::TemplateRecord::of);
    let cpuid = machine.vcpus[0]
        .cpuid
        .iter()
        .map(|e| CpuidEntry {
            function: e.function,
            index: e.index,
            flags: e.flags,
            eax: e.eax,
            ebx: e.ebx,
            ecx: e.ecx,
            edx: e.edx,
        })
        .collect();
    (cpuid, compat, host, machine)
}

#[test]
fn test_this_host_satisfies_t2() {
    let host = host_compat(Path::new(KVM)).expect("host compat");
    let satisfied = host.satisfied_templates();
    println!("{} satisfies {satisfied:?}", host.cpu_vendor);
    if let Err(gaps) = host.satisfies(&t2()) {
        let text: Vec<String> = gaps.iter().map(ToString::to_string).collect();
        panic!("this host does not satisfy t2:\n{}", text.join("\n"));
    }
}

#[test]
fn test_probe_vcpu_gets_the_template() {
    let t = t2();
    let (cpuid, compat, mut host) = probe(Some(t.clone()));
    matches_template(&t, &cpuid, "the vCPU's CPUID (KVM_GET_CPUID2)");
    check(&compat, &host).expect("its own host");

    // Booted without a template, the same guest sees the host's features.
    let (plain_cpuid, plain, _) = probe(None);
    // A feature of this host that t2 hides (AVX-512, SHA, ...): the plain
    // guest saw it, the templated one did not.
    let hidden = snapshot::compat::missing_cpu_features(&plain_cpuid, &cpuid);
    println!(
        "t2 hid {} of this host's features: {:?}",
        hidden.len(),
        names(&hidden)
    );
    // A host offer without them: the templated snapshot still wakes there,
    // the plain one is refused as before templates, naming the first.
    let Some(&first) = hidden.first() else {
        println!("this host has nothing t2 hides; nothing more to show");
        return;
    };
    let mut poorer = host.clone();
    for b in &hidden {
        clear(&mut poorer, *b);
    }
    if let Err(e) = check(&compat, &poorer) {
        panic!("a t2 snapshot refused by a host that satisfies t2:\n{e}");
    }
    let err = check(&plain, &poorer).expect_err("the plain snapshot saw them");
    assert!(
        err.mismatches.contains(&Mismatch::CpuFeature {
            name: feature_name(first),
            bit: first
        }),
        "{err}"
    );
    assert!(err.to_string().contains("--cpu-template t2"), "{err}");

    // A host offer without AVX2 (t2 needs it): the templated snapshot is
    // refused naming it and the template.
    let avx2 = CpuidBit {
        function: 7,
        index: 0,
        register: Register::Ebx,
        bit: 5,
    };
    clear(&mut host, avx2);
    let err = check(&compat, &host).expect_err("no avx2");
    assert_eq!(
        err.mismatches,
        vec![Mismatch::TemplateFeature {
            template: "t2".into(),
            name: Some("avx2"),
            bit: avx2
        }],
        "{err}"
    );
    println!("{err}");
}

fn clear(host: &mut HostCompat, b: CpuidBit) {
    for e in host
        .cpuid
        .iter_mut()
        .filter(|e| e.matches(b.function, b.index))
    {
        let r = match b.register {
            Register::Eax => &mut e.eax,
            Register::Ebx => &mut e.ebx,
            Register::Ecx => &mut e.ecx,
            Register::Edx => &mut e.edx,
        };
        *r &= !(1 << b.bit);
    }
}

#[test]
fn test_a_host_that_lacks_a_template_feature_refuses_the_boot() {
    let host = host_compat(Path::new(KVM)).expect("host compat");
    // A template asking for a leaf 7 EBX feature this host lacks.
    let offered = host
        .cpuid
        .iter()
        .find(|e| e.matches(7, 0))
        .map_or(0, |e| e.ebx);
    let Some(bit) = (0..32).find(|b| offered & (1 << b) == 0) else {
        println!("this host offers every leaf 7 EBX feature");
        return;
    };
    let bitmap: String = (0..32)
        .rev()
        .map(|b| if b == bit { '1' } else { 'x' })
        .collect();
    let json = format!(
        r#"{{"name": "too-rich", "cpuid_modifiers": [{{"leaf": "0x7", "subleaf": "0x0", "flags": 1,
            "modifiers": [{{"register": "ebx", "bitmap": "0b{bitmap}"}}]}}]}}"#
    );
    let t = Template::parse(&json, "test").expect("valid template");
    let config = VmConfig {
        kernel: guests::counter_path().into(),
        mem_mib: 64,
        cpu_template: Some(t),
        ..Default::default()
    };
    let err = match vmm::build(&config) {
        Ok(_) => panic!("booted under a template this host does not satisfy"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("does not satisfy CPU template too-rich"),
        "{err}"
    );
    assert!(err.contains(&format!("EBX bit {bit}")), "{err}");
    println!("{err}");
}

/// The guest's own view, under t2, before and after a snapshot and a
/// restore in a new VMM process.
#[test]
fn test_guest_sees_the_template_across_snapshot_and_restore() {
    let t = t2();
    let dir = scratch("cputpl", "guest");
    let console = Console::in_dir(&dir, "vm");
    let kernel = guests::cpuid_path();
    let cfg = VmConfig {
        cpu_template: Some(t.clone()),
        ..config(kernel, 64, &console)
    };
    let p = VmmProcess::spawn(&dir, "vm", move || vmm::build(&cfg).expect("build"));
    console.wait_nth("READY", 1);
    let seen = guest_cpuid(&console);
    matches_template(&t, &seen, "the guest's own CPUID");
    // The guest sees a vendor, AVX2 and no PCID (t2 hides it).
    assert!(seen[0].ebx != 0, "leaf 0 vendor");
    assert_ne!(seen[2].ebx & (1 << 5), 0, "avx2 shown");
    assert_eq!(seen[1].ecx & (1 << 17), 0, "pcid hidden");

    let snap = dir.join("snap");
    let r = p
        .call(&Request::Snapshot {
            dir: snap.clone(),
            layers_dir: dir.join("layers"),
            contract: None,
        })
        .expect("snapshot");
    let (manifest, _) = vmm::snapshot_dir::load(&snap).expect("load");
    let rec = manifest
        .compat
        .cpu_template
        .clone()
        .expect("template recorded");
    assert_eq!(
        (rec.name.as_str(), rec.hash.as_str()),
        ("t2", t.hash().as_str())
    );
    let text = std::fs::read_to_string(snap.join("manifest.json")).expect("manifest");
    assert!(text.contains("\"cpu_template\""), "{text}");
    vmm::snapshot_dir::check_host(&snap, &manifest, Path::new(KVM)).expect("this host");
    // The vm runs on (in a continuation process, for a booted vm).
    micro::kill(p.pid);
    if let Some(c) = r.continuation_pid {
        micro::kill(c as i32);
    }
    p.wait(Duration::from_secs(5));

    let restored = Console::in_dir(&dir, "restored");
    let rc = restored.clone();
    let snap2 = snap.clone();
    let q = VmmProcess::spawn(&dir, "restored", move || {
        let (manifest, moment) = vmm::snapshot_dir::load(&snap2).expect("load");
        let config = VmConfig {
            mem_mib: manifest.mem_mib,
            cpu_template: manifest.compat.cpu_template.map(|r| r.template),
            ..config(Path::new("/"), manifest.mem_mib, &rc)
        };
        let mem = vmm::memory::map_file_private(
            &snap2.join(vmm::snapshot_dir::MEMORY),
            &moment.ram_regions(),
        )
        .expect("map memory");
        vmm::restore(&config, mem, vmm::memory::RamBacking::Private, &moment).expect("restore")
    });
    assert_eq!(
        restored.command("ping", "PONG", 1),
        "PONG",
        "the restored guest answers"
    );
    let after = guest_cpuid(&restored);
    // The same CPUID as before the snapshot (leaf 1 EBX holds the APIC
    // ID, the same vCPU 0).
    assert_eq!(after, seen);
    // Its own next snapshot records the template again.
    let snap3 = dir.join("snap-again");
    let r = q
        .call(&Request::Snapshot {
            dir: snap3.clone(),
            layers_dir: dir.join("layers"),
            contract: None,
        })
        .expect("snapshot of the restored vm");
    let (again, _) = vmm::snapshot_dir::load(&snap3).expect("load");
    assert_eq!(again.compat.cpu_template.map(|r| r.hash), Some(t.hash()));
    micro::kill(q.pid);
    if let Some(c) = r.continuation_pid {
        micro::kill(c as i32);
    }
    q.wait(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(dir);
}

/// A custom template's MSR modifier reaches the vCPU: IA32_MISC_ENABLE
/// with "BTS unavailable" and "PEBS unavailable" (bits 11, 12) set over
/// KVM's value, fast strings (bit 0, set at boot) kept, read back from the
/// saved vCPU state.
#[test]
fn test_msr_modifier_is_applied() {
    const MISC_ENABLE: u32 = 0x1a0;
    let host = host_compat(Path::new(KVM)).expect("host compat");
    if !host.msrs.contains(&MISC_ENABLE) {
        println!("this host's KVM does not list IA32_MISC_ENABLE; nothing to show");
        return;
    }
    let bitmap: String = (0..64)
        .rev()
        .map(|b| if b == 11 || b == 12 { '1' } else { 'x' })
        .collect();
    let mut json: serde_json::Value = serde_json::from_str(&t2().to_json()).expect("json");
    json["name"] = "t2-misc".into();
    json["msr_modifiers"] = serde_json::json!([{"addr": "0x1a0", "bitmap": format!("0b{bitmap}")}]);
    let t = Template::parse(&json.to_string(), "test").expect("valid");
    host.satisfies(&t).expect("the MSR is listed");
    let (_, compat, _, machine) = probe_machine(Some(t.clone()));
    let misc = machine.vcpus[0]
        .msrs
        .iter()
        .find(|m| m.index == MISC_ENABLE)
        .expect("IA32_MISC_ENABLE saved")
        .data;
    assert_eq!(
        misc & ((1 << 11) | (1 << 12) | 1),
        (1 << 11) | (1 << 12) | 1,
        "{misc:#x}"
    );
    assert_eq!(
        compat.cpu_template.map(|r| r.hash),
        Some(t.hash()),
        "recorded"
    );
    // Without the modifier, KVM leaves bits 11 and 12 clear.
    let (_, _, _, plain) = probe_machine(Some(t2()));
    let misc = plain.vcpus[0]
        .msrs
        .iter()
        .find(|m| m.index == MISC_ENABLE)
        .expect("saved")
        .data;
    assert_eq!(misc & ((1 << 11) | (1 << 12)), 0, "{misc:#x}");
}

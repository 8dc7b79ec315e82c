//! No page of generated code is ever writable and executable at once: after
//! the kernels are built, /proc/self/maps shows no mapping with both `w` and
//! `x`, and the kernels' own mapping is read+execute.

use pulsar::engine::fast::WeightFormats;
use pulsar::engine::jit_kernels::JitKernels;
use pulsar::engine::packed::WeightFormat;
use pulsar::model::presets;

fn executable_mappings() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps is readable");
    maps.lines()
        .filter(|l| l.split_whitespace().nth(1).is_some_and(|p| p.contains('x')))
        .map(str::to_string)
        .collect()
}

#[test]
fn generated_code_is_never_writable_and_executable() {
    let before = executable_mappings().len();
    let mut sets = Vec::new();
    for config in [presets::gemma3_270m(), presets::gemma_2b()] {
        for format in [WeightFormat::F16, WeightFormat::BF16] {
            sets.push(
                JitKernels::build(&config, WeightFormats::uniform(format), 2)
                    .expect("JIT builds on this CPU"),
            );
        }
    }
    let after = executable_mappings();
    assert!(
        after.len() > before,
        "building kernels added no executable mapping: the test would prove nothing"
    );
    for line in &after {
        let perms = line.split_whitespace().nth(1).unwrap_or("");
        assert!(
            !perms.contains('w'),
            "writable and executable mapping: {line}"
        );
    }
    drop(sets);
}

//! What the CPU can do: instruction-set features, cache sizes and cores.

use raw_cpuid::{CacheType, CpuId};
use std::fmt;

/// The ISA ceiling a plan may use; `--max-isa` lowers it below what the CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Isa {
    Avx2,
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

impl std::str::FromStr for Isa {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "avx2" => Ok(Isa::Avx2),
            "avx512" => Ok(Isa::Avx512),
            _ => Err(format!("unknown ISA \"{s}\"; use avx2 or avx512")),
        }
    }
}

/// Features and cache geometry detected with CPUID.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CpuCaps {
    pub vendor: String,
    pub brand: String,
    pub avx: bool,
    pub avx2: bool,
    pub f16c: bool,
    pub fma: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512_bf16: bool,
    pub avx512_vnni: bool,
    /// Data/unified cache sizes in bytes for levels 1..=3 (0 when unknown).
    pub l1d: usize,
    pub l2: usize,
    pub l3: usize,
    /// Logical CPUs this process may run on.
    pub cores: usize,
}

impl CpuCaps {
    /// Reads the running CPU.
    pub fn detect() -> CpuCaps {
        let cpuid = CpuId::new();
        let vendor = cpuid
            .get_vendor_info()
            .map(|v| v.as_str().to_string())
            .unwrap_or_default();
        let brand = cpuid
            .get_processor_brand_string()
            .map(|b| b.as_str().trim().to_string())
            .unwrap_or_default();
        let fi = cpuid.get_feature_info();
        let ef = cpuid.get_extended_feature_info();
        let has = |f: fn(&raw_cpuid::ExtendedFeatures) -> bool| ef.as_ref().is_some_and(f);
        // AVX state must also be enabled by the OS (OSXSAVE); without it the
        // ymm registers are not saved across context switches.
        let osxsave = fi.as_ref().is_some_and(|f| f.has_oxsave());
        let mut caps = CpuCaps {
            vendor,
            brand,
            avx: osxsave && fi.as_ref().is_some_and(|f| f.has_avx()),
            avx2: osxsave && has(|e| e.has_avx2()),
            f16c: fi.as_ref().is_some_and(|f| f.has_f16c()),
            fma: fi.as_ref().is_some_and(|f| f.has_fma()),
            avx512f: osxsave && has(|e| e.has_avx512f()),
            avx512bw: has(|e| e.has_avx512bw()),
            avx512vl: has(|e| e.has_avx512vl()),
            avx512_bf16: has(|e| e.has_avx512_bf16()),
            avx512_vnni: has(|e| e.has_avx512vnni()),
            l1d: 0,
            l2: 0,
            l3: 0,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        // Leaf 4 on Intel, 0x8000001D on AMD (raw-cpuid picks by vendor); the
        // legacy AMD leaf 0x80000006 misreports L3 on this machine, so it is not used.
        if let Some(iter) = cpuid.get_cache_parameters() {
            for c in iter {
                let size = c.associativity()
                    * c.physical_line_partitions()
                    * c.coherency_line_size()
                    * c.sets();
                match (c.level(), c.cache_type()) {
                    (1, CacheType::Data | CacheType::Unified) => caps.l1d = size,
                    (2, CacheType::Data | CacheType::Unified) => caps.l2 = size,
                    (3, CacheType::Data | CacheType::Unified) => caps.l3 = size,
                    _ => {}
                }
            }
        }
        caps
    }

    /// A CPU that can run the AVX2 kernels: AVX2 + F16C + FMA.
    pub fn has_jit_baseline(&self) -> bool {
        self.avx && self.avx2 && self.f16c && self.fma
    }

    /// The AVX-512 subset a plan would use.
    pub fn has_avx512(&self) -> bool {
        self.avx512f && self.avx512bw && self.avx512vl
    }

    /// Highest ISA both the CPU and the user allow; None means no JIT at all.
    pub fn effective_isa(&self, max: Isa) -> Option<Isa> {
        if !self.has_jit_baseline() {
            return None;
        }
        if max >= Isa::Avx512 && self.has_avx512() {
            Some(Isa::Avx512)
        } else {
            Some(Isa::Avx2)
        }
    }

    /// The message shown instead of crashing on an old CPU.
    pub fn baseline_message(&self) -> Option<String> {
        if self.has_jit_baseline() {
            return None;
        }
        let missing: Vec<&str> = [
            ("AVX", self.avx),
            ("AVX2", self.avx2),
            ("F16C", self.f16c),
            ("FMA", self.fma),
        ]
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(n, _)| *n)
        .collect();
        Some(format!(
            "this CPU lacks {}; the JIT kernels need AVX2+F16C+FMA, so the reference engine is used",
            missing.join(", ")
        ))
    }

    /// A fixed Zen 4-like description, for deterministic plan tests.
    pub fn zen4_like() -> CpuCaps {
        CpuCaps {
            vendor: "AuthenticAMD".into(),
            brand: "test Zen 4".into(),
            avx: true,
            avx2: true,
            f16c: true,
            fma: true,
            avx512f: true,
            avx512bw: true,
            avx512vl: true,
            avx512_bf16: true,
            avx512_vnni: true,
            l1d: 32 * 1024,
            l2: 1024 * 1024,
            l3: 32 * 1024 * 1024,
            cores: 2,
        }
    }
}

impl fmt::Display for CpuCaps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let flag = |b: bool, n: &'static str| if b { n } else { "" };
        let feats: Vec<&str> = [
            flag(self.avx2, "avx2"),
            flag(self.f16c, "f16c"),
            flag(self.fma, "fma"),
            flag(self.avx512f, "avx512f"),
            flag(self.avx512bw, "avx512bw"),
            flag(self.avx512vl, "avx512vl"),
            flag(self.avx512_bf16, "avx512_bf16"),
            flag(self.avx512_vnni, "avx512_vnni"),
        ]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
        write!(
            f,
            "{} ({}) cores={} L1d={}K L2={}K L3={}K features=[{}]",
            self.brand,
            self.vendor,
            self.cores,
            self.l1d / 1024,
            self.l2 / 1024,
            self.l3 / 1024,
            feats.join(" ")
        )
    }
}

//! The seeded random generator: xoshiro256** seeded through splitmix64,
//! implemented here so that a seed gives the same draws on any build.

/// xoshiro256** (Blackman & Vigna), seeded by splitmix64: small, fast, and
/// fixed forever because it lives here rather than in a dependency.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut st = seed;
        // splitmix64 never yields four zero words, the one state xoshiro cannot leave.
        Rng {
            s: [
                splitmix64(&mut st),
                splitmix64(&mut st),
                splitmix64(&mut st),
                splitmix64(&mut st),
            ],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_and_xoshiro_are_pinned() {
        // First splitmix64 output for seed 0, a published reference value.
        assert_eq!(splitmix64(&mut 0), 0xE220_A839_7B1D_CDAF);
        // Golden values of this generator: changing them changes every seeded run.
        let mut r = Rng::new(42);
        let got: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(got, GOLDEN_SEED_42);
        let f = Rng::new(7).next_f64();
        assert!((0.0..1.0).contains(&f));
    }

    // Cross-checked against an independent Python transcription of the algorithm.
    const GOLDEN_SEED_42: [u64; 3] = [
        1546998764402558742,
        6990951692964543102,
        12544586762248559009,
    ];
}

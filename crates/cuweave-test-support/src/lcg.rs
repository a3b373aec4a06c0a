//! [`Lcg`]: the deterministic pseudo-random numbers of randomized tests (the same workload on
//! every run, so a failure replays).

/// Knuth's MMIX linear congruential generator (multiplier 6364136223846793005, increment
/// 1442695040888963407): the generator the randomized tests share.
#[derive(Debug, Clone)]
pub struct Lcg {
    state: u64,
}

impl Lcg {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// Advances the generator and returns its whole new state (the high bits are the best
    /// mixed: callers shift them down).
    pub fn next_state(&mut self) -> u64 {
        self.state = self
            .state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.state
    }

    /// A number below `bound` (not 0), from the state's 31 high bits.
    pub fn below(&mut self, bound: u64) -> u64 {
        (self.next_state() >> 33) % bound
    }
}

#[cfg(test)]
mod tests {
    use super::Lcg;

    #[test]
    fn the_sequence_is_the_mmix_recurrence_and_below_stays_below() {
        let mut lcg = Lcg::new(1);
        assert_eq!(
            lcg.next_state(),
            6_364_136_223_846_793_005_u64.wrapping_add(1_442_695_040_888_963_407)
        );
        let mut again = Lcg::new(7);
        let mut other = Lcg::new(7);
        for _ in 0..1000 {
            let value = again.below(13);
            assert!(value < 13);
            assert_eq!(value, (other.next_state() >> 33) % 13);
        }
    }
}

//! [`MigrationPolicy`]: a named placement for managed memory, and the advice it stands for.

use std::fmt;

use cuweave_driver::memory::MemLocation;

use super::advice::MemAdvice;

/// Where managed memory should live, as one choice that turns into advice calls.
///
/// [`ManagedMemoryHints::apply_policy`](super::ManagedMemoryHints::apply_policy) replaces the
/// range's policy: it clears what any policy could have set (read-mostly, the preferred
/// location, every accessed-by) and then issues [`advice`](Self::advice).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MigrationPolicy {
    /// The driver's default: pages migrate to whichever processor faults on them.
    #[default]
    Default,
    /// Mostly-read data: read-only copies on every processor that reads it.
    ReadMostly,
    /// Keep the pages on this device, mapped there so its accesses do not fault; other
    /// processors access them remotely where they can instead of migrating them.
    PreferDevice(usize),
    /// Keep the pages in host memory; devices access them remotely where they can.
    PreferHost,
}

impl MigrationPolicy {
    /// The advice calls this policy stands for, in order, aimed where it says.
    ///
    /// - `Default`: unset read-mostly and the preferred location (accessed-by advice names a
    ///   location, so `apply_policy` clears it from what the range reports);
    /// - `ReadMostly`: set read-mostly;
    /// - `PreferDevice(d)`: preferred location device `d`, accessed by device `d`;
    /// - `PreferHost`: preferred location host. No accessed-by: the host is where the pages
    ///   live, so it never faults on them, and the policy names no device to map them into.
    pub fn advice(&self) -> Vec<MemAdvice> {
        match *self {
            Self::Default => vec![
                MemAdvice::UnsetReadMostly,
                MemAdvice::UnsetPreferredLocation,
            ],
            Self::ReadMostly => vec![MemAdvice::SetReadMostly],
            Self::PreferDevice(ordinal) => vec![
                MemAdvice::SetPreferredLocation(MemLocation::Device(ordinal)),
                MemAdvice::SetAccessedBy(MemLocation::Device(ordinal)),
            ],
            Self::PreferHost => vec![MemAdvice::SetPreferredLocation(MemLocation::Host)],
        }
    }
}

impl fmt::Display for MigrationPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Default => f.write_str("default"),
            Self::ReadMostly => f.write_str("read-mostly"),
            Self::PreferDevice(ordinal) => write!(f, "prefer-device({ordinal})"),
            Self::PreferHost => f.write_str("prefer-host"),
        }
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case::default(
        MigrationPolicy::Default,
        vec![MemAdvice::UnsetReadMostly, MemAdvice::UnsetPreferredLocation]
    )]
    #[case::read_mostly(MigrationPolicy::ReadMostly, vec![MemAdvice::SetReadMostly])]
    #[case::device_0(
        MigrationPolicy::PreferDevice(0),
        vec![
            MemAdvice::SetPreferredLocation(MemLocation::Device(0)),
            MemAdvice::SetAccessedBy(MemLocation::Device(0)),
        ]
    )]
    #[case::device_1(
        MigrationPolicy::PreferDevice(1),
        vec![
            MemAdvice::SetPreferredLocation(MemLocation::Device(1)),
            MemAdvice::SetAccessedBy(MemLocation::Device(1)),
        ]
    )]
    #[case::host(
        MigrationPolicy::PreferHost,
        vec![MemAdvice::SetPreferredLocation(MemLocation::Host)]
    )]
    fn policies_stand_for_their_advice(
        #[case] policy: MigrationPolicy,
        #[case] advice: Vec<MemAdvice>,
    ) {
        assert_eq!(policy.advice(), advice);
    }

    #[rstest]
    #[case(MigrationPolicy::Default, "default")]
    #[case(MigrationPolicy::ReadMostly, "read-mostly")]
    #[case(MigrationPolicy::PreferDevice(1), "prefer-device(1)")]
    #[case(MigrationPolicy::PreferDevice(12), "prefer-device(12)")]
    #[case(MigrationPolicy::PreferHost, "prefer-host")]
    fn policies_display_their_names(#[case] policy: MigrationPolicy, #[case] name: &str) {
        assert_eq!(policy.to_string(), name);
    }

    #[test]
    fn no_policy_aims_anywhere_but_where_it_says() {
        for ordinal in 0..4 {
            for advice in MigrationPolicy::PreferDevice(ordinal).advice() {
                assert_eq!(advice.location(), Some(MemLocation::Device(ordinal)));
            }
        }
        for advice in MigrationPolicy::PreferHost.advice() {
            assert_eq!(advice.location(), Some(MemLocation::Host));
        }
        assert_eq!(MigrationPolicy::default(), MigrationPolicy::Default);
    }
}

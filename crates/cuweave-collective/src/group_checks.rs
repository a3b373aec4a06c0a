//! What a group's calls must satisfy before NCCL sees them, decided with no CUDA and no NCCL:
//! the streams' capture status, and the pairing of sends with receives.
//!
//! NCCL finds both problems only once a communicator has taken part of the work: a group whose
//! streams mix captures is `ncclInvalidUsage` from `ncclGroupEnd` (an asynchronous error on a
//! non-blocking communicator, and "permanently trashed" communicators across ranks), and a
//! send whose receive expects other bytes hangs on the GPU or leaves bytes in the connection
//! for the next transfer. [`crate::collective`] gathers what the calls are (which communicator,
//! which stream's capture, which peer, how many bytes) and asks these functions first, so such
//! a group is an `InvalidArgument` with every communicator untouched.

use crate::comm::World;

/// One communicator (one rank object) of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Party {
    /// Its NCCL communicator, when known ([`World`]).
    pub(crate) world: Option<World>,
    /// Its rank there.
    pub(crate) rank: usize,
}

impl Party {
    /// Whether sends from `self` to `other`'s rank are received by `other`: the same rank
    /// object, or two ranks of one known communicator.
    fn pairs_with(&self, other: &Party, same_object: bool) -> bool {
        same_object
            || (self.world.is_some() && self.world == other.world && self.rank != other.rank)
    }
}

/// Checks the capture status of a group's streams by NCCL's two rules: the calls of one
/// communicator use streams that are all uncaptured or all captured by the same capture, and
/// the group's communicators are all uncaptured or all captured. `calls` holds, per call, the
/// index of its communicator in `parties` and its stream's capture id (`None`: not capturing).
///
/// # Errors
/// What is wrong, in words.
pub(crate) fn check_captures(
    parties: &[Party],
    calls: &[(usize, Option<u64>)],
) -> Result<(), String> {
    // Per communicator, the capture of its first call.
    let mut first: Vec<Option<Option<u64>>> = vec![None; parties.len()];
    for &(party, capture) in calls {
        match first[party] {
            None => first[party] = Some(capture),
            Some(seen) if seen == capture => {}
            Some(seen) => {
                let rank = parties[party].rank;
                return Err(match (seen, capture) {
                    (Some(a), Some(b)) => format!(
                        "rank {rank}'s calls use streams of two captures ({a} and {b}): NCCL \
                         needs a communicator's streams in one group all uncaptured or all \
                         captured by the same capture"
                    ),
                    (Some(id), None) | (None, Some(id)) => format!(
                        "rank {rank}'s calls use a capturing stream (capture {id}) and one that \
                         is not capturing: NCCL needs a communicator's streams in one group all \
                         uncaptured or all captured by the same capture"
                    ),
                    (None, None) => unreachable!("equal"),
                });
            }
        }
    }
    let captured = first
        .iter()
        .enumerate()
        .find_map(|(i, c)| c.flatten().map(|id| (i, id)));
    let eager = first.iter().position(|c| *c == Some(None));
    if let (Some((captured, id)), Some(eager)) = (captured, eager) {
        return Err(format!(
            "rank {}'s streams are captured (capture {id}) and rank {}'s are not: NCCL needs \
             either none or all of a group's communicators captured",
            parties[captured].rank, parties[eager].rank
        ));
    }
    Ok(())
}

/// Which way a point-to-point call moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// `ncclSend` to `peer`.
    Send,
    /// `ncclRecv` from `peer`.
    Recv,
}

/// A send or a receive of a group, in the order it was added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PointToPoint {
    /// Its communicator's index in the group's parties.
    pub(crate) party: usize,
    pub(crate) direction: Direction,
    /// The other rank.
    pub(crate) peer: usize,
    /// Bytes moved (element count × element size; NCCL moves bytes, so element types may
    /// differ between the two sides).
    pub(crate) bytes: usize,
}

/// Checks that a group's communicators (each given as its rank and whether it is blocking) are
/// all blocking or all non-blocking. NCCL refuses the mix ("Blocking and nonblocking
/// communicators are not allowed in the same group", `ncclInvalidArgument`) only once the group
/// is under way, after communicators may have taken their part.
///
/// # Errors
/// What is wrong, in words.
pub(crate) fn check_blocking(ranks: &[(usize, bool)]) -> Result<(), String> {
    let Some(&(first_rank, first)) = ranks.first() else {
        return Ok(());
    };
    match ranks.iter().find(|&&(_, blocking)| blocking != first) {
        None => Ok(()),
        Some(&(rank, blocking)) => {
            let kind = |blocking: bool| if blocking { "blocking" } else { "non-blocking" };
            Err(format!(
                "rank {first_rank}'s communicator is {} and rank {rank}'s is {}: NCCL does not \
                 allow blocking and non-blocking communicators in one group",
                kind(first),
                kind(blocking)
            ))
        }
    }
}

/// Checks that every send and receive whose two sides are both in hand pair up: NCCL pairs the
/// k-th send from rank a to rank b with the k-th receive at b from a, and only the two sides
/// issued together progress together, so, for every ordered pair of parties that are one
/// rank object (a rank's exchange with itself) or two ranks of one known communicator, the
/// sends from the first to the second and the receives at the second from the first must be
/// as many, with equal bytes in order. Sends to a rank not in hand (another process or
/// thread) are not checked; nor are ranks whose communicator this process cannot tell apart.
///
/// # Errors
/// What is wrong, in words.
pub(crate) fn check_pairs(parties: &[Party], calls: &[PointToPoint]) -> Result<(), String> {
    for (s, sender) in parties.iter().enumerate() {
        for (r, receiver) in parties.iter().enumerate() {
            if !sender.pairs_with(receiver, s == r) {
                continue;
            }
            let sends: Vec<usize> = calls
                .iter()
                .filter(|c| {
                    c.party == s && c.direction == Direction::Send && c.peer == receiver.rank
                })
                .map(|c| c.bytes)
                .collect();
            let recvs: Vec<usize> = calls
                .iter()
                .filter(|c| c.party == r && c.direction == Direction::Recv && c.peer == sender.rank)
                .map(|c| c.bytes)
                .collect();
            let (a, b) = (sender.rank, receiver.rank);
            if sends.len() != recvs.len() {
                return Err(if s == r {
                    format!(
                        "rank {a} sends to itself {} times and receives from itself {} times: \
                         each send to itself needs a receive from itself in the same Group",
                        sends.len(),
                        recvs.len()
                    )
                } else {
                    format!(
                        "rank {a} sends to rank {b} {} times but rank {b} receives from rank \
                         {a} {} times in this Group: both sides of an exchange between ranks \
                         driven from one thread must be in one Group, as many on each side",
                        sends.len(),
                        recvs.len()
                    )
                });
            }
            if let Some((i, (send, recv))) = sends
                .iter()
                .zip(&recvs)
                .enumerate()
                .find(|(_, (send, recv))| send != recv)
            {
                return Err(if s == r {
                    format!(
                        "rank {a}'s send {i} to itself is {send} bytes but the receive it pairs \
                         with is {recv} bytes"
                    )
                } else {
                    format!(
                        "rank {a}'s send {i} to rank {b} is {send} bytes but rank {b}'s receive \
                         it pairs with is {recv} bytes"
                    )
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[test]
    fn blocking_and_non_blocking_communicators_do_not_share_a_group() {
        assert!(check_blocking(&[]).is_ok());
        assert!(check_blocking(&[(0, true), (1, true)]).is_ok());
        assert!(check_blocking(&[(0, false), (1, false), (2, false)]).is_ok());
        let refused = check_blocking(&[(0, false), (1, false), (2, true)]).unwrap_err();
        assert!(
            refused.starts_with("rank 0's communicator is non-blocking and rank 2's is blocking"),
            "{refused}"
        );
    }

    const W: Option<World> = Some(World::Local(1));

    fn party(world: Option<World>, rank: usize) -> Party {
        Party { world, rank }
    }

    fn send(party: usize, peer: usize, bytes: usize) -> PointToPoint {
        PointToPoint {
            party,
            direction: Direction::Send,
            peer,
            bytes,
        }
    }

    fn recv(party: usize, peer: usize, bytes: usize) -> PointToPoint {
        PointToPoint {
            party,
            direction: Direction::Recv,
            peer,
            bytes,
        }
    }

    #[rstest]
    #[case::all_eager(&[(0, None), (0, None), (1, None)])]
    #[case::one_capture(&[(0, Some(7)), (0, Some(7)), (1, Some(7))])]
    #[case::each_communicator_its_own_capture(&[(0, Some(7)), (1, Some(9)), (1, Some(9))])]
    #[case::nothing(&[])]
    fn streams_all_eager_or_all_captured_consistently_pass(#[case] calls: &[(usize, Option<u64>)]) {
        let parties = [party(W, 0), party(W, 1)];
        assert_eq!(check_captures(&parties, calls), Ok(()));
    }

    #[rstest]
    #[case::one_communicator_captured_and_eager(&[(0, Some(7)), (0, None)], "capture 7")]
    #[case::one_communicator_eager_then_captured(&[(0, None), (0, Some(7))], "capture 7")]
    #[case::one_communicator_two_captures(&[(0, Some(7)), (0, Some(9))], "two captures")]
    #[case::one_rank_captured_the_other_eager(&[(0, Some(7)), (1, None)], "none or all")]
    #[case::one_rank_eager_the_other_captured(&[(0, None), (1, Some(7)), (1, Some(7))], "none or all")]
    fn streams_that_mix_captures_are_refused(
        #[case] calls: &[(usize, Option<u64>)],
        #[case] says: &str,
    ) {
        let parties = [party(W, 0), party(W, 1)];
        let error = check_captures(&parties, calls).expect_err("refused");
        assert!(error.contains(says), "{error}");
    }

    #[test]
    fn self_exchanges_pair_in_order_by_bytes() {
        let one = [party(None, 0)];
        assert_eq!(
            check_pairs(
                &one,
                &[
                    send(0, 0, 64),
                    send(0, 0, 80),
                    recv(0, 0, 64),
                    recv(0, 0, 80)
                ]
            ),
            Ok(())
        );
        let out_of_order = check_pairs(
            &one,
            &[
                send(0, 0, 64),
                send(0, 0, 80),
                recv(0, 0, 80),
                recv(0, 0, 64),
            ],
        );
        assert!(
            out_of_order
                .expect_err("refused")
                .contains("send 0 to itself is 64 bytes")
        );
        let lone = check_pairs(&one, &[send(0, 0, 64)]);
        assert!(
            lone.expect_err("refused")
                .contains("1 times and receives from itself 0")
        );
    }

    #[test]
    fn two_ranks_of_one_communicator_pair_their_sends_and_receives() {
        let parties = [party(W, 0), party(W, 1)];
        // A ring of two: each sends to and receives from the other, equal bytes.
        let ring = [
            send(0, 1, 16),
            recv(0, 1, 16),
            send(1, 0, 16),
            recv(1, 0, 16),
        ];
        assert_eq!(check_pairs(&parties, &ring), Ok(()));
        // Same bytes, other element types on each side.
        assert_eq!(
            check_pairs(&parties, &[send(0, 1, 16384), recv(1, 0, 16384)]),
            Ok(())
        );
        let short = check_pairs(&parties, &[send(0, 1, 16384), recv(1, 0, 8192)]);
        assert!(short.expect_err("refused").contains(
            "rank 0's send 0 to rank 1 is 16384 bytes but rank 1's receive it pairs with is 8192"
        ));
        let lone = check_pairs(&parties, &[send(0, 1, 16)]);
        assert!(
            lone.expect_err("refused")
                .contains("rank 1 receives from rank 0 0 times")
        );
        let lone_recv = check_pairs(&parties, &[recv(1, 0, 16)]);
        assert!(
            lone_recv
                .expect_err("refused")
                .contains("sends to rank 1 0 times")
        );
    }

    #[test]
    fn sides_not_in_hand_or_of_unknown_or_other_communicators_are_not_judged() {
        // Rank 1 is in another process: nothing to compare with.
        assert_eq!(check_pairs(&[party(W, 0)], &[send(0, 1, 16)]), Ok(()));
        // Unknown worlds, or two communicators that merely share rank numbers.
        let unknown = [party(None, 0), party(None, 1)];
        assert_eq!(
            check_pairs(&unknown, &[send(0, 1, 16), recv(1, 0, 8)]),
            Ok(())
        );
        let other = [party(W, 0), party(Some(World::Local(2)), 1)];
        assert_eq!(
            check_pairs(&other, &[send(0, 1, 16), recv(1, 0, 8)]),
            Ok(())
        );
        // The same id digest is the same communicator.
        let joined = [party(Some(World::Id(5)), 0), party(Some(World::Id(5)), 1)];
        assert!(check_pairs(&joined, &[send(0, 1, 16), recv(1, 0, 8)]).is_err());
    }
}

//! Who decides a request's fate when its caller gives up (the request timeout) while its batch is
//! about to commit: exactly one of the two wins, so a timeout says "nothing was changed" only when
//! that is true.
//!
//! A request starts `waiting`. Before sending `COMMIT`, the batch claims every request in it
//! ([`CommitClaim::claim`]); a request whose caller already gave up cannot be claimed, and the
//! batch rolls back instead (its other requests go into the next one). A caller giving up
//! ([`CommitClaim::abandon`]) learns whether its request can still be left out, or is being (or
//! was) committed, in which case its outcome is unknown to it.

use std::sync::atomic::{AtomicU8, Ordering};

const WAITING: u8 = 0;
const COMMITTING: u8 = 1;
const ABANDONED: u8 = 2;

/// The race between a request's batch committing and its caller giving up.
#[derive(Debug, Default)]
pub struct CommitClaim(AtomicU8);

impl CommitClaim {
    /// The batch is about to commit the request's writes: true if its caller still waits, who
    /// from now on cannot give up without being told the outcome is unknown.
    pub fn claim(&self) -> bool {
        self.0
            .compare_exchange(WAITING, COMMITTING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The batch rolled back after claiming: the request waits again.
    pub fn release(&self) {
        let _ = self
            .0
            .compare_exchange(COMMITTING, WAITING, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The caller gives up: true if the request will not be committed (now or ever), false if a
    /// batch claimed it first and its writes may have committed.
    pub fn abandon(&self) -> bool {
        match self
            .0
            .compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(state) => state == ABANDONED,
        }
    }

    /// Whether the caller gave up (the batch must leave the request out).
    pub fn is_abandoned(&self) -> bool {
        self.0.load(Ordering::Acquire) == ABANDONED
    }
}

/// Claims every one of `claims` for commit, or none: if one was abandoned, those claimed are
/// released and false is returned.
pub fn claim_all<'c>(claims: impl IntoIterator<Item = &'c CommitClaim> + Clone) -> bool {
    for (claimed, claim) in claims.clone().into_iter().enumerate() {
        if !claim.claim() {
            for earlier in claims.into_iter().take(claimed) {
                earlier.release();
            }
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_caller_that_gives_up_first_keeps_its_request_out() {
        let c = CommitClaim::default();
        assert!(c.abandon());
        assert!(c.is_abandoned());
        assert!(!c.claim(), "an abandoned request is never committed");
        assert!(
            c.abandon(),
            "giving up twice still says nothing was committed"
        );
    }

    #[test]
    fn a_request_claimed_first_cannot_be_given_up_as_unchanged() {
        let c = CommitClaim::default();
        assert!(c.claim());
        assert!(!c.abandon(), "it may have committed");
        assert!(!c.is_abandoned());
    }

    #[test]
    fn a_released_request_can_be_given_up_again() {
        let c = CommitClaim::default();
        assert!(c.claim());
        c.release();
        assert!(c.abandon());
        assert!(!c.claim());
    }

    #[test]
    fn claim_all_is_all_or_none() {
        let claims: Vec<CommitClaim> = (0..3).map(|_| CommitClaim::default()).collect();
        assert!(claims[2].abandon());
        assert!(!claim_all(claims.iter()));
        // The first two were released: their callers may still give up as unchanged.
        assert!(claims[0].abandon() && claims[1].abandon());

        let fresh: Vec<CommitClaim> = (0..3).map(|_| CommitClaim::default()).collect();
        assert!(claim_all(fresh.iter()));
        assert!(fresh.iter().all(|c| !c.abandon()));
    }

    #[test]
    fn exactly_one_side_wins_a_race() {
        for _ in 0..2_000 {
            let c = Arc::new(CommitClaim::default());
            let batch = {
                let c = Arc::clone(&c);
                std::thread::spawn(move || c.claim())
            };
            let gave_up_unchanged = c.abandon();
            let committed = batch.join().unwrap();
            assert_ne!(
                committed, gave_up_unchanged,
                "one of them, never both or neither"
            );
        }
    }
}

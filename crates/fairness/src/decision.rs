//! The fairness decisions, as pure functions: which fetched candidates may start, whether a job
//! that bypassed the gate is over its user's limit, and how long it snoozes.

use std::collections::HashMap;
use std::time::Duration;

use queue::JobId;
use uuid::Uuid;

/// A runnable job offered to the gate, in fetch order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub job_id: JobId,
    /// `None` for a system job (no limit applies).
    pub user_id: Option<Uuid>,
}

/// Chooses, in order, up to `capacity` candidates that may start: system jobs always, a user's
/// job only while the user's running jobs plus those admitted here stay below their limit.
pub fn admit(
    candidates: &[Candidate],
    running: &HashMap<Uuid, u32>,
    limit_of: impl Fn(&Uuid) -> u32,
    capacity: usize,
) -> Vec<JobId> {
    let mut taken: HashMap<Uuid, u32> = HashMap::new();
    let mut admitted = Vec::with_capacity(capacity.min(candidates.len()));
    for c in candidates {
        if admitted.len() >= capacity {
            break;
        }
        match c.user_id {
            None => admitted.push(c.job_id),
            Some(user) => {
                let now = running.get(&user).copied().unwrap_or(0)
                    + taken.get(&user).copied().unwrap_or(0);
                if now < limit_of(&user) {
                    *taken.entry(user).or_insert(0) += 1;
                    admitted.push(c.job_id);
                }
            }
        }
    }
    admitted
}

/// For a job that reached a worker without the gate: whether the user's *other* running jobs
/// already fill the limit (then this one must wait).
pub fn over_limit(other_running: u32, limit: u32) -> bool {
    other_running >= limit
}

/// The snooze of an over-limit job: `base` plus a `unit_random ∈ [0, 1)` share of `jitter`.
pub fn snooze_for(base: Duration, jitter: Duration, unit_random: f64) -> Duration {
    base + jitter.mul_f64(unit_random.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FREE: Uuid = Uuid::from_u128(1);
    const PRO: Uuid = Uuid::from_u128(2);
    const ENT: Uuid = Uuid::from_u128(3);
    const FREE2: Uuid = Uuid::from_u128(4);

    fn c(id: JobId, user: Option<Uuid>) -> Candidate {
        Candidate {
            job_id: id,
            user_id: user,
        }
    }

    fn limits(user: &Uuid) -> u32 {
        match *user {
            FREE | FREE2 => 1,
            PRO => 3,
            _ => 5,
        }
    }

    #[test]
    fn adr10_scenario_free_gets_one_pro_gets_three() {
        // Ten Free jobs first, then three Pro jobs, five workers free.
        let mut candidates: Vec<_> = (1..=10).map(|i| c(i, Some(FREE))).collect();
        candidates.extend((11..=13).map(|i| c(i, Some(PRO))));
        let admitted = admit(&candidates, &HashMap::new(), limits, 5);
        assert_eq!(
            admitted,
            [1, 11, 12, 13],
            "the Free user's backlog does not block Pro"
        );
    }

    #[test]
    fn running_jobs_count_against_the_limit() {
        let running = HashMap::from([(PRO, 2), (FREE, 1)]);
        let candidates = [c(1, Some(FREE)), c(2, Some(PRO)), c(3, Some(PRO))];
        assert_eq!(admit(&candidates, &running, limits, 10), [2]);
    }

    #[test]
    fn system_jobs_are_exempt_and_capacity_is_respected() {
        let running = HashMap::from([(FREE, 1)]);
        let candidates = [c(1, None), c(2, Some(FREE)), c(3, None), c(4, None)];
        assert_eq!(admit(&candidates, &running, limits, 2), [1, 3]);
        assert_eq!(admit(&candidates, &running, limits, 0), Vec::<JobId>::new());
    }

    #[test]
    fn never_over_any_limit_on_random_inputs() {
        // A small deterministic generator: no dependency, reproducible failures.
        let mut state: u64 = 42;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as usize
        };
        let users = [FREE, PRO, ENT, FREE2];
        let limit_of = limits;
        for _ in 0..2000 {
            let running: HashMap<Uuid, u32> =
                users.iter().map(|u| (*u, (next() % 6) as u32)).collect();
            let candidates: Vec<Candidate> = (0..(next() % 40))
                .map(|i| {
                    let user = if next() % 5 == 0 {
                        None
                    } else {
                        Some(users[next() % 4])
                    };
                    c(i as JobId, user)
                })
                .collect();
            let capacity = next() % 20;
            let admitted = admit(&candidates, &running, limit_of, capacity);
            assert!(admitted.len() <= capacity);
            for user in users {
                let before = running[&user];
                let added = candidates
                    .iter()
                    .filter(|c| c.user_id == Some(user) && admitted.contains(&c.job_id))
                    .count() as u32;
                assert!(
                    added == 0 || before + added <= limit_of(&user),
                    "{user}: {before} running + {added} admitted > {}",
                    limit_of(&user)
                );
            }
            // Admission keeps fetch order.
            let positions: Vec<usize> = admitted
                .iter()
                .map(|id| candidates.iter().position(|c| c.job_id == *id).unwrap())
                .collect();
            assert!(positions.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn over_limit_and_snooze() {
        assert!(over_limit(1, 1));
        assert!(!over_limit(0, 1));
        assert!(!over_limit(2, 3));
        let base = Duration::from_secs(30);
        let jitter = Duration::from_secs(10);
        assert_eq!(snooze_for(base, jitter, 0.0), base);
        assert_eq!(snooze_for(base, jitter, 0.5), Duration::from_secs(35));
        assert!(snooze_for(base, jitter, 0.999_999) < Duration::from_secs(40));
    }
}

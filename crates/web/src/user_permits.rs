//! Per-user shares of a limited resource: at most `per_user` permits for one user at once, that
//! user's further requests waiting for their own, so one user cannot hold every slot of a shared
//! limit (the `git ls-remote` slots, `RESOLVE_CONCURRENCY_PER_USER`). A user's entry exists only
//! while one of their requests holds or waits for a permit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;
use uuid::Uuid;

/// The per-user semaphores.
#[derive(Debug)]
pub struct UserPermits {
    per_user: usize,
    users: Mutex<HashMap<Uuid, Arc<Semaphore>>>,
}

/// A user's place at their semaphore: waiting for a permit, then holding it. Dropping it, at
/// either stage (a request that timed out while it waited too), gives back what it holds and
/// forgets the user once no request of theirs holds or waits.
#[derive(Debug)]
pub struct UserPermit {
    semaphore: Option<Arc<Semaphore>>,
    holding: bool,
    user: Uuid,
    permits: Arc<UserPermits>,
}

impl UserPermits {
    /// At most `per_user` (at least 1) permits per user at once.
    pub fn new(per_user: usize) -> Arc<UserPermits> {
        Arc::new(UserPermits {
            per_user: per_user.max(1),
            users: Mutex::new(HashMap::new()),
        })
    }

    /// Waits for one of `user`'s permits.
    pub async fn acquire(self: &Arc<Self>, user: Uuid) -> UserPermit {
        let semaphore = Arc::clone(
            self.lock()
                .entry(user)
                .or_insert_with(|| Arc::new(Semaphore::new(self.per_user))),
        );
        let mut place = UserPermit {
            semaphore: Some(semaphore),
            holding: false,
            user,
            permits: Arc::clone(self),
        };
        if let Some(semaphore) = &place.semaphore
            // Never closed: the semaphores are only ever dropped, not closed.
            && let Ok(permit) = semaphore.acquire().await
        {
            // Given back by hand when `place` is dropped, which owns the semaphore's handle.
            permit.forget();
            place.holding = true;
        }
        place
    }

    /// Users with a permit held or awaited.
    pub fn users(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Arc<Semaphore>>> {
        self.users
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for UserPermit {
    fn drop(&mut self) {
        if let Some(semaphore) = self.semaphore.take() {
            if self.holding {
                semaphore.add_permits(1);
            }
            drop(semaphore);
        }
        let mut users = self.permits.lock();
        // Only the map holds it: no request of this user holds or waits for a permit (each
        // holds a handle while it does, taken under this lock).
        if users
            .get(&self.user)
            .is_some_and(|semaphore| Arc::strong_count(semaphore) == 1)
        {
            users.remove(&self.user);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_user_waits_for_their_own_permits_only_and_is_forgotten_after() {
        let permits = UserPermits::new(2);
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let first = permits.acquire(a).await;
        let second = permits.acquire(a).await;
        let third = tokio::spawn({
            let permits = Arc::clone(&permits);
            async move { permits.acquire(a).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!third.is_finished(), "a third permit for one user");
        // Another user is not kept waiting.
        let other = tokio::time::timeout(Duration::from_secs(1), permits.acquire(b))
            .await
            .expect("another user's permit");
        assert_eq!(permits.users(), 2);
        drop(first);
        let third = tokio::time::timeout(Duration::from_secs(1), third)
            .await
            .expect("the freed permit")
            .unwrap();
        drop(other);
        assert_eq!(permits.users(), 1, "b holds nothing and is forgotten");
        drop((second, third));
        assert_eq!(permits.users(), 0);
    }

    /// A request given the freed permit, but cancelled before it ran again (its timeout), still
    /// leaves no entry and no permit behind.
    #[tokio::test(flavor = "current_thread")]
    async fn a_waiter_cancelled_after_its_permit_was_freed_leaves_nothing() {
        let permits = UserPermits::new(1);
        let user = Uuid::now_v7();
        let held = permits.acquire(user).await;
        let waiter = tokio::spawn({
            let permits = Arc::clone(&permits);
            async move { permits.acquire(user).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        // The permit passes to the waiter, which is cancelled before it is polled again.
        drop(held);
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        assert_eq!(permits.users(), 0, "the user's entry stayed behind");
        // And the permit was not lost with it.
        let again = tokio::time::timeout(Duration::from_secs(1), permits.acquire(user))
            .await
            .expect("the user's permit");
        drop(again);
        assert_eq!(permits.users(), 0);
    }
}

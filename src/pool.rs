//! A fixed pool of named threads with deep stacks for CPU work that must
//! not run on an async worker nor on the store's writer: converting a
//! Delegate body (schema compilation, predicate composition) and judging a
//! completion. Started once; at most `count` jobs run or wait at once, and
//! an async caller never waits longer than its deadline.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Semaphore, oneshot};

type Job = Box<dyn FnOnce() + Send>;

/// Why a job gave no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The job ran past the caller's deadline (it may still be running:
    /// threads cannot be preempted, so every job must bound its own work).
    #[error("the work did not finish within {0} ms")]
    TimedOut(u64),
    /// The job panicked (a bug); the thread lives on.
    #[error("the work panicked")]
    Panicked,
    /// The pool has stopped.
    #[error("the work pool has stopped")]
    Stopped,
}

/// A pool of `count` threads; cloning shares it.
#[derive(Clone)]
pub struct WorkPool {
    jobs: std::sync::mpsc::SyncSender<Job>,
    /// One permit per thread: a job is queued only with one, so the queue
    /// (as deep as the pool) never fills, and waiting callers wait here,
    /// asynchronously.
    permits: Arc<Semaphore>,
}

impl WorkPool {
    /// Starts `count` threads named `name-i` with `stack_bytes` stacks.
    /// They stop when every clone of the pool is dropped.
    pub fn start(name: &str, count: usize, stack_bytes: usize) -> std::io::Result<Self> {
        let (jobs, queue) = std::sync::mpsc::sync_channel::<Job>(count);
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..count {
            let queue = queue.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .stack_size(stack_bytes)
                .spawn(move || {
                    loop {
                        // The lock is only held while waiting for a job.
                        let job = queue
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .recv();
                        let Ok(job) = job else { break };
                        // A job that panics loses its answer, not the thread.
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                    }
                })?;
        }
        Ok(Self {
            jobs,
            permits: Arc::new(Semaphore::new(count)),
        })
    }

    /// Runs `work` on a pool thread and waits for its answer at most
    /// `deadline` in all (waiting for a free thread included). The permit
    /// stays with the job until it ends, so a caller that gives up does not
    /// let more jobs run than there are threads.
    pub async fn run<T: Send + 'static>(
        &self,
        deadline: Duration,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, PoolError> {
        let timed_out =
            PoolError::TimedOut(u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX));
        tokio::time::timeout(deadline, async {
            let permit = self
                .permits
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| PoolError::Stopped)?;
            let (done, answer) = oneshot::channel();
            let job: Job = Box::new(move || {
                let _permit = permit;
                let _ = done.send(work());
            });
            self.jobs.try_send(job).map_err(|_| PoolError::Stopped)?;
            // A dropped sender without an answer: the job panicked.
            answer.await.map_err(|_| PoolError::Panicked)
        })
        .await
        .map_err(|_| timed_out)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn runs_jobs_bounds_them_and_never_waits_past_the_deadline() {
        let pool = WorkPool::start("test-pool", 2, 1 << 20).unwrap();
        assert_eq!(pool.run(Duration::from_secs(5), || 7).await, Ok(7));
        // A panic loses the answer, not the thread.
        assert_eq!(
            pool.run(Duration::from_secs(5), || panic!("boom")).await,
            Err::<(), _>(PoolError::Panicked)
        );
        // Two slow jobs hold both threads; a third caller gives up at its
        // deadline instead of waiting for them.
        let running = Arc::new(AtomicUsize::new(0));
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let mut slow = Vec::new();
        for _ in 0..2 {
            let (pool, running, gate) = (pool.clone(), running.clone(), gate.clone());
            slow.push(tokio::spawn(async move {
                pool.run(Duration::from_secs(30), move || {
                    running.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.lock().unwrap().recv();
                })
                .await
            }));
        }
        while running.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            pool.run(Duration::from_millis(50), || 1).await,
            Err(PoolError::TimedOut(50))
        );
        release.send(()).unwrap();
        release.send(()).unwrap();
        for s in slow {
            assert_eq!(s.await.unwrap(), Ok(()));
        }
        assert_eq!(pool.run(Duration::from_secs(5), || 3).await, Ok(3));
    }
}

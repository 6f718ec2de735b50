//! A fixed pool of named threads with deep stacks for CPU work that must
//! not run on an async worker nor on the store's writer: converting a
//! Delegate body (schema compilation, predicate composition) and judging a
//! completion. Started once; at most `count` jobs run at once, and an
//! async caller never waits longer than its deadline.
//!
//! Shared fairly, not first come first served: every job names its
//! `Share` (a tenant, and a key within it), and a freed thread goes to the
//! next tenant with waiting work in turn, and within a tenant to its next
//! key in turn. A tenant flooding the pool therefore delays another
//! tenant's job by at most one job per other waiting tenant, however many
//! it queues; and its queue is bounded (`MAX_WAITING_PER_TENANT`), past
//! which it is told at once (`PoolError::Full`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

pub use broker_domain::limits::MAX_WAITING_PER_TENANT;
use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send>;

/// Who a job is for: the tenant it is charged to (the opener of the tree
/// it works for) and the key that asked, its share within the tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Share {
    pub tenant: [u8; 32],
    pub key: [u8; 32],
}

/// Why a job gave no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The job ran past the caller's deadline, or waited for a thread
    /// until it (it may still be running: threads cannot be preempted, so
    /// every job must bound its own work).
    #[error("the work did not finish within {0} ms")]
    TimedOut(u64),
    /// The tenant already has `MAX_WAITING_PER_TENANT` jobs waiting.
    #[error("the tenant has {MAX_WAITING_PER_TENANT} jobs waiting already")]
    Full,
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
    jobs: Arc<Closer>,
    /// Free threads and the callers waiting for one: a job is queued only
    /// with a `Turn`, so the queue (as deep as the pool) never fills.
    turns: FairQueue,
}

/// The jobs handed to the pool's threads. Each idle thread sleeps on
/// `ready`, so a job wakes exactly one (a receiver shared behind a mutex
/// woke a second thread per job, to take the lock and wait in turn: a
/// wake-up of an idle core each time on a small VM).
struct Jobs {
    queue: Mutex<JobQueue>,
    ready: Condvar,
}

struct JobQueue {
    jobs: VecDeque<Job>,
    /// Most jobs queued at once: the pool's thread count.
    capacity: usize,
    /// Set when the last clone of the pool is gone: threads finish what
    /// is queued and stop.
    closed: bool,
}

impl Jobs {
    fn lock(&self) -> MutexGuard<'_, JobQueue> {
        // A push or a pop is a single step: a poisoned lock still holds a
        // usable queue.
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues `job` for the next idle thread; false if the queue is full
    /// or closed.
    fn push(&self, job: Job) -> bool {
        let mut queue = self.lock();
        if queue.closed || queue.jobs.len() >= queue.capacity {
            return false;
        }
        queue.jobs.push_back(job);
        drop(queue);
        self.ready.notify_one();
        true
    }

    /// The next job, waiting for one; `None` once closed and drained.
    fn next(&self) -> Option<Job> {
        let mut queue = self.lock();
        loop {
            if let Some(job) = queue.jobs.pop_front() {
                return Some(job);
            }
            if queue.closed {
                return None;
            }
            queue = self
                .ready
                .wait(queue)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// Held by every clone of the pool (the threads hold `Jobs` itself):
/// dropping the last closes the queue, and the threads stop.
struct Closer(Arc<Jobs>);

impl Drop for Closer {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.ready.notify_all();
    }
}

/// `count` places handed out fairly (tenants in turn, then keys), each
/// wait bounded by its caller's deadline: the threads of a `WorkPool`, or
/// any scarce work (audits). Cloning shares it.
#[derive(Clone)]
pub struct FairQueue {
    turns: Arc<Mutex<Turns>>,
}

impl FairQueue {
    pub fn new(count: usize) -> Self {
        Self {
            turns: Arc::new(Mutex::new(Turns {
                free: count,
                ..Turns::default()
            })),
        }
    }

    /// A place for `share`, once it is its turn, within `deadline`.
    pub async fn acquire(&self, share: Share, deadline: Duration) -> Result<Turn, PoolError> {
        let timed_out =
            PoolError::TimedOut(u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX));
        let waiting = self.enqueue(share)?;
        tokio::time::timeout(deadline, async {
            match waiting {
                Ok(turn) => Ok(turn),
                Err(turn) => turn.await.map_err(|_| PoolError::Stopped),
            }
        })
        .await
        .map_err(|_| timed_out)?
    }

    /// A place now, or the receiver of one in turn.
    fn enqueue(&self, share: Share) -> Result<Result<Turn, oneshot::Receiver<Turn>>, PoolError> {
        let mut turns = lock(&self.turns);
        if turns.free > 0 && turns.ring.is_empty() {
            turns.free -= 1;
            Ok(Ok(Turn {
                turns: self.turns.clone(),
                held: true,
            }))
        } else {
            let (waiter, turn) = oneshot::channel();
            turns.enqueue(share, waiter)?;
            Ok(Err(turn))
        }
    }

    /// Callers waiting for a place.
    pub fn waiting(&self) -> usize {
        lock(&self.turns).tenants.values().map(|t| t.count).sum()
    }
}

/// The fair queue of callers waiting for a thread.
#[derive(Default)]
struct Turns {
    free: usize,
    /// Tenants with waiters, in the order they are served.
    ring: VecDeque<[u8; 32]>,
    tenants: HashMap<[u8; 32], Tenant>,
}

#[derive(Default)]
struct Tenant {
    /// Keys with waiters, in the order they are served.
    ring: VecDeque<[u8; 32]>,
    waiting: HashMap<[u8; 32], VecDeque<oneshot::Sender<Turn>>>,
    count: usize,
}

impl Turns {
    /// The next waiter in fair order, if any (it may have given up).
    fn next(&mut self) -> Option<oneshot::Sender<Turn>> {
        while let Some(tenant_key) = self.ring.pop_front() {
            let Some(tenant) = self.tenants.get_mut(&tenant_key) else {
                continue;
            };
            while let Some(key) = tenant.ring.pop_front() {
                let Some(queue) = tenant.waiting.get_mut(&key) else {
                    continue;
                };
                let Some(waiter) = queue.pop_front() else {
                    tenant.waiting.remove(&key);
                    continue;
                };
                tenant.count = tenant.count.saturating_sub(1);
                if queue.is_empty() {
                    tenant.waiting.remove(&key);
                } else {
                    tenant.ring.push_back(key);
                }
                if tenant.ring.is_empty() {
                    self.tenants.remove(&tenant_key);
                } else {
                    self.ring.push_back(tenant_key);
                }
                return Some(waiter);
            }
            self.tenants.remove(&tenant_key);
        }
        None
    }

    fn enqueue(&mut self, share: Share, waiter: oneshot::Sender<Turn>) -> Result<(), PoolError> {
        let new_tenant = !self.tenants.contains_key(&share.tenant);
        let tenant = self.tenants.entry(share.tenant).or_default();
        if tenant.count >= MAX_WAITING_PER_TENANT {
            // Waiters that gave up still count until they are passed over;
            // dropping them here lets a tenant whose callers timed out in.
            tenant.waiting.retain(|_, queue| {
                queue.retain(|w| !w.is_closed());
                !queue.is_empty()
            });
            tenant.count = tenant.waiting.values().map(VecDeque::len).sum();
            let Tenant { ring, waiting, .. } = tenant;
            ring.retain(|key| waiting.contains_key(key));
            if tenant.count >= MAX_WAITING_PER_TENANT {
                return Err(PoolError::Full);
            }
        }
        let queue = tenant.waiting.entry(share.key).or_default();
        if queue.is_empty() {
            // Keys in the ring are exactly those with waiters.
            tenant.ring.push_back(share.key);
        }
        queue.push_back(waiter);
        tenant.count += 1;
        if new_tenant {
            self.ring.push_back(share.tenant);
        }
        Ok(())
    }
}

/// A place held (a thread for one job, an audit); handing it back gives
/// it to the next waiter in fair order.
pub struct Turn {
    turns: Arc<Mutex<Turns>>,
    /// False once handed on (or never given out): dropping it does nothing.
    held: bool,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        let turns = self.turns.clone();
        let mut locked = lock(&turns);
        loop {
            let Some(waiter) = locked.next() else {
                locked.free += 1;
                return;
            };
            let turn = Turn {
                turns: turns.clone(),
                held: true,
            };
            match waiter.send(turn) {
                Ok(()) => return,
                // The caller gave up: the thread goes to the next one.
                Err(mut unsent) => unsent.held = false,
            }
        }
    }
}

fn lock(turns: &Mutex<Turns>) -> MutexGuard<'_, Turns> {
    // Every change is a single step on plain data: a poisoned lock still
    // holds a usable queue.
    turns
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl WorkPool {
    /// Callers waiting for a thread (for tests).
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.turns.waiting()
    }

    /// Starts `count` threads named `name-i` with `stack_bytes` stacks.
    /// They stop when every clone of the pool is dropped.
    pub fn start(name: &str, count: usize, stack_bytes: usize) -> std::io::Result<Self> {
        let jobs = Arc::new(Jobs {
            queue: Mutex::new(JobQueue {
                jobs: VecDeque::with_capacity(count),
                capacity: count,
                closed: false,
            }),
            ready: Condvar::new(),
        });
        // Made first: if a later thread cannot be started, dropping it
        // stops the ones already waiting.
        let closer = Arc::new(Closer(jobs.clone()));
        for i in 0..count {
            let jobs = jobs.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .stack_size(stack_bytes)
                .spawn(move || {
                    while let Some(job) = jobs.next() {
                        // A job that panics loses its answer, not the thread.
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                    }
                })?;
        }
        Ok(Self {
            jobs: closer,
            turns: FairQueue::new(count),
        })
    }

    /// Runs `work` for `share` on a pool thread, and waits for its answer
    /// at most `deadline` in all (waiting for its turn included). The
    /// thread stays taken until the job ends, so a caller that gives up
    /// does not let more jobs run than there are threads.
    pub async fn run<T: Send + 'static>(
        &self,
        share: Share,
        deadline: Duration,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, PoolError> {
        let timed_out =
            PoolError::TimedOut(u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX));
        let waiting = self.turns.enqueue(share)?;
        tokio::time::timeout(deadline, async {
            let turn = match waiting {
                Ok(turn) => turn,
                Err(turn) => turn.await.map_err(|_| PoolError::Stopped)?,
            };
            let (done, answer) = oneshot::channel();
            let job: Job = Box::new(move || {
                let _turn = turn;
                let _ = done.send(work());
            });
            if !self.jobs.0.push(job) {
                return Err(PoolError::Stopped);
            }
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

    const ONE: Share = Share {
        tenant: [1; 32],
        key: [1; 32],
    };

    #[tokio::test]
    async fn runs_jobs_bounds_them_and_never_waits_past_the_deadline() {
        let pool = WorkPool::start("test-pool", 2, 1 << 20).unwrap();
        assert_eq!(pool.run(ONE, Duration::from_secs(5), || 7).await, Ok(7));
        // A panic loses the answer, not the thread.
        assert_eq!(
            pool.run(ONE, Duration::from_secs(5), || panic!("boom"))
                .await,
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
                pool.run(ONE, Duration::from_secs(30), move || {
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
            pool.run(ONE, Duration::from_millis(50), || 1).await,
            Err(PoolError::TimedOut(50))
        );
        release.send(()).unwrap();
        release.send(()).unwrap();
        for s in slow {
            assert_eq!(s.await.unwrap(), Ok(()));
        }
        assert_eq!(pool.run(ONE, Duration::from_secs(5), || 3).await, Ok(3));
    }

    /// One thread; tenant A queues 20 jobs under one key and 1 under
    /// another, then tenant B queues 1: B's job runs second (after A's
    /// next in turn), and A's second key's job before A's first key's
    /// backlog; first come first served would have run them last.
    #[tokio::test]
    async fn a_freed_thread_goes_to_the_next_tenant_and_key_in_turn() {
        let pool = WorkPool::start("fair-pool", 1, 1 << 20).unwrap();
        let order = Arc::new(Mutex::new(Vec::<&'static str>::new()));
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let job = |name: &'static str| {
            let (order, gate) = (order.clone(), gate.clone());
            move || {
                order.lock().unwrap().push(name);
                let _ = gate.lock().unwrap().recv();
            }
        };
        let share = |tenant: u8, key: u8| Share {
            tenant: [tenant; 32],
            key: [key; 32],
        };
        let mut tasks = Vec::new();
        let mut submit = |share: Share, work: Box<dyn FnOnce() + Send>| {
            let pool = pool.clone();
            tasks.push(tokio::spawn(async move {
                pool.run(share, Duration::from_secs(30), work).await
            }));
        };
        submit(share(1, 1), Box::new(job("a-first")));
        while order.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        for _ in 0..20 {
            submit(share(1, 1), Box::new(job("a-backlog")));
        }
        submit(share(1, 2), Box::new(job("a-other-key")));
        while pool.waiting() < 21 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        submit(share(2, 9), Box::new(job("b")));
        while pool.waiting() < 22 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        for _ in 0..23 {
            release.send(()).unwrap();
        }
        for task in tasks {
            assert_eq!(task.await.unwrap(), Ok(()));
        }
        let order = order.lock().unwrap().clone();
        assert_eq!(&order[..4], ["a-first", "a-backlog", "b", "a-other-key"]);
        assert_eq!(order.len(), 23);
    }

    /// A tenant's waiting jobs are bounded; callers that gave up do not
    /// count against it for long.
    #[tokio::test]
    async fn a_tenants_queue_is_bounded() {
        let pool = WorkPool::start("bounded-pool", 1, 1 << 20).unwrap();
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let busy = {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.run(ONE, Duration::from_secs(30), move || {
                    let _ = gate.recv();
                })
                .await
            })
        };
        let mut waiting = Vec::new();
        for _ in 0..MAX_WAITING_PER_TENANT {
            let pool = pool.clone();
            waiting.push(tokio::spawn(async move {
                pool.run(ONE, Duration::from_millis(200), || ()).await
            }));
        }
        while pool.waiting() < MAX_WAITING_PER_TENANT {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(
            pool.run(ONE, Duration::from_secs(1), || ()).await,
            Err(PoolError::Full)
        );
        // Another tenant still queues.
        let other = Share {
            tenant: [2; 32],
            key: [2; 32],
        };
        assert_eq!(
            pool.run(other, Duration::from_millis(10), || ()).await,
            Err(PoolError::TimedOut(10))
        );
        for w in waiting {
            assert_eq!(w.await.unwrap(), Err(PoolError::TimedOut(200)));
        }
        // Those that gave up are passed over: the tenant queues again.
        let again = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.run(ONE, Duration::from_secs(30), || 5).await })
        };
        release.send(()).unwrap();
        assert_eq!(busy.await.unwrap(), Ok(()));
        assert_eq!(again.await.unwrap(), Ok(5));
    }

    /// Every thread serves jobs, and every thread stops once the last
    /// clone of the pool is dropped (each signals its exit from a
    /// thread-local's destructor).
    #[tokio::test]
    async fn its_threads_stop_when_the_last_clone_is_dropped() {
        struct Exit(std::sync::mpsc::Sender<std::thread::ThreadId>);
        impl Drop for Exit {
            fn drop(&mut self) {
                let _ = self.0.send(std::thread::current().id());
            }
        }
        thread_local! {
            static EXIT: std::cell::RefCell<Option<Exit>> = const { std::cell::RefCell::new(None) };
        }
        const THREADS: usize = 3;
        let pool = WorkPool::start("test-stop", THREADS, 1 << 20).unwrap();
        let (exits, exited) = std::sync::mpsc::channel();
        // Jobs that hold their thread until all have started: each thread
        // takes one, and marks itself to report its exit.
        let started = Arc::new(std::sync::Barrier::new(THREADS));
        let jobs: Vec<_> = (0..THREADS)
            .map(|_| {
                let (pool, exits, started) = (pool.clone(), exits.clone(), started.clone());
                tokio::spawn(async move {
                    pool.run(ONE, Duration::from_secs(5), move || {
                        EXIT.with(|e| *e.borrow_mut() = Some(Exit(exits)));
                        started.wait();
                        std::thread::current().id()
                    })
                    .await
                })
            })
            .collect();
        let mut served = std::collections::HashSet::new();
        for job in jobs {
            served.insert(job.await.unwrap().unwrap());
        }
        assert_eq!(served.len(), THREADS, "each job on its own thread");
        // Still serving while a clone lives.
        assert_eq!(pool.run(ONE, Duration::from_secs(5), || 7).await, Ok(7));
        assert!(exited.try_recv().is_err(), "a thread stopped early");
        drop((pool, exits));
        let mut stopped = std::collections::HashSet::new();
        while stopped.len() < THREADS {
            let id = exited
                .recv_timeout(Duration::from_secs(5))
                .expect("a pool thread did not stop after the pool was dropped");
            stopped.insert(id);
        }
        assert_eq!(stopped, served);
    }

    /// The job queue holds no more than the pool's threads, and takes
    /// nothing once closed; what it holds is still handed out after.
    #[test]
    fn the_job_queue_is_bounded_and_closes() {
        let jobs = Arc::new(Jobs {
            queue: Mutex::new(JobQueue {
                jobs: VecDeque::new(),
                capacity: 1,
                closed: false,
            }),
            ready: Condvar::new(),
        });
        assert!(jobs.push(Box::new(|| {})));
        assert!(!jobs.push(Box::new(|| {})), "past the capacity");
        drop(Closer(jobs.clone()));
        assert!(jobs.next().is_some(), "a queued job outlives the close");
        assert!(jobs.next().is_none(), "closed and drained");
        assert!(!jobs.push(Box::new(|| {})), "closed");
    }
}

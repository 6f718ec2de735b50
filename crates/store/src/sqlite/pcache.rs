//! SQLite's default page cache, with one needless scan taken out.
//!
//! While a database is under 1 GiB, a B-tree balance that reorders pages
//! (`balance_nonroot`) files one for a moment under the lock page's
//! number (1 GiB / page size + 1). The default cache then remembers that
//! number as the largest it has seen, and at the end of the transaction,
//! asked to drop the pages past the database's end, it scans its whole
//! hash table, though there are none: ~6% of the writer's time under
//! `bench` (BENCHMARKS.md). This wrapper keeps its own largest key,
//! leaving the lock page's number out while it only passes through, and
//! skips a truncation that has nothing to drop. Every other call goes to
//! the default cache as it is.
//!
//! Why it is sound: a page enters a cache only through `xFetch` or
//! changes its key only through `xRekey`, and both raise `max_key` to
//! cover it, except a rekey to the lock page's number, which is counted
//! in `at_lock_page` until the page is rekeyed away. So while no page
//! sits there, no page has a key above `max_key`, and a truncation from
//! above it drops nothing.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

use libsqlite3_sys as ffi;

/// SQLite's lock byte (`PENDING_BYTE`): the page holding it is never
/// used, so `balance_nonroot` borrows its number.
const PENDING_BYTE: u64 = 0x4000_0000;

/// The default cache's methods, read once before SQLite initializes.
struct Inner(ffi::sqlite3_pcache_methods2);
// SAFETY: the methods are plain functions and `pArg` is the default
// cache's (unused by it); they are only read after being set once.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

static INNER_CACHE: OnceLock<Inner> = OnceLock::new();

/// One connection's cache: the default cache's, and what it holds.
struct Cache {
    inner: *mut ffi::sqlite3_pcache,
    /// The lock page's number at this cache's page size.
    lock_page: c_uint,
    /// No page in the cache has a larger key, except any at `lock_page`.
    max_key: c_uint,
    /// Pages rekeyed to `lock_page` and not yet away from it.
    at_lock_page: u32,
}

/// Installs the wrapper as SQLite's page cache. It must come before
/// SQLite initializes (any connection or VFS lookup); false if it could
/// not (SQLite already initialized), and the default cache serves as it
/// is.
pub(super) fn install() -> bool {
    // SAFETY: `sqlite3_config` is not thread-safe: it is called once (the
    // caller's `OnceLock`), before anything in the process touches
    // SQLite — every connection is opened after `gather::register`,
    // which calls this first (ARCHITECTURE.md). SQLite copies the struct.
    unsafe {
        let mut default = std::mem::zeroed::<ffi::sqlite3_pcache_methods2>();
        if ffi::sqlite3_config(
            ffi::SQLITE_CONFIG_GETPCACHE2,
            &mut default as *mut ffi::sqlite3_pcache_methods2,
        ) != ffi::SQLITE_OK
            || INNER_CACHE.set(Inner(default)).is_err()
        {
            return false;
        }
        let ours = ffi::sqlite3_pcache_methods2 {
            iVersion: 1,
            pArg: std::ptr::null_mut(),
            xInit: Some(init),
            xShutdown: Some(shutdown),
            xCreate: Some(create),
            xCachesize: Some(cache_size),
            xPagecount: Some(page_count),
            xFetch: Some(fetch),
            xUnpin: Some(unpin),
            xRekey: Some(rekey),
            xTruncate: Some(truncate),
            xDestroy: Some(destroy),
            xShrink: Some(shrink),
        };
        ffi::sqlite3_config(
            ffi::SQLITE_CONFIG_PCACHE2,
            &ours as *const ffi::sqlite3_pcache_methods2,
        ) == ffi::SQLITE_OK
    }
}

fn inner() -> &'static ffi::sqlite3_pcache_methods2 {
    // Only reachable once `install` set it: SQLite calls these methods
    // only after it took them.
    match INNER_CACHE.get() {
        Some(inner) => &inner.0,
        None => std::process::abort(),
    }
}

/// Calls one of the default cache's methods (all are set in SQLite's).
macro_rules! call {
    ($method:ident($($arg:expr),*)) => {
        match inner().$method {
            Some(f) => f($($arg),*),
            None => std::process::abort(),
        }
    };
}

unsafe extern "C" fn init(_: *mut c_void) -> c_int {
    // SAFETY: forwarded as SQLite would call the default cache.
    unsafe { call!(xInit(inner().pArg)) }
}

unsafe extern "C" fn shutdown(_: *mut c_void) {
    // SAFETY: as `init`.
    unsafe { call!(xShutdown(inner().pArg)) }
}

unsafe extern "C" fn create(
    page_bytes: c_int,
    extra_bytes: c_int,
    purgeable: c_int,
) -> *mut ffi::sqlite3_pcache {
    // SAFETY: forwarded; a null cache is SQLite's out-of-memory.
    let inner = unsafe { call!(xCreate(page_bytes, extra_bytes, purgeable)) };
    if inner.is_null() {
        return inner;
    }
    let page_bytes = u64::try_from(page_bytes).unwrap_or(1).max(1);
    let lock_page = c_uint::try_from(PENDING_BYTE / page_bytes + 1).unwrap_or(c_uint::MAX);
    Box::into_raw(Box::new(Cache {
        inner,
        lock_page,
        max_key: 0,
        at_lock_page: 0,
    }))
    .cast()
}

/// The wrapper behind a cache pointer SQLite got from `create`.
///
/// # Safety
/// `cache` came from `create` and is not destroyed; SQLite calls a
/// cache's methods from one thread at a time.
unsafe fn ours<'a>(cache: *mut ffi::sqlite3_pcache) -> &'a mut Cache {
    // SAFETY: the caller's.
    unsafe { &mut *cache.cast::<Cache>() }
}

unsafe extern "C" fn cache_size(cache: *mut ffi::sqlite3_pcache, pages: c_int) {
    // SAFETY: `cache` is one of ours (SQLite's contract).
    unsafe { call!(xCachesize(ours(cache).inner, pages)) }
}

unsafe extern "C" fn page_count(cache: *mut ffi::sqlite3_pcache) -> c_int {
    // SAFETY: as `cache_size`.
    unsafe { call!(xPagecount(ours(cache).inner)) }
}

unsafe extern "C" fn fetch(
    cache: *mut ffi::sqlite3_pcache,
    key: c_uint,
    create: c_int,
) -> *mut ffi::sqlite3_pcache_page {
    // SAFETY: as `cache_size`.
    unsafe {
        let cache = ours(cache);
        let page = call!(xFetch(cache.inner, key, create));
        if !page.is_null() && key > cache.max_key {
            cache.max_key = key;
        }
        page
    }
}

unsafe extern "C" fn unpin(
    cache: *mut ffi::sqlite3_pcache,
    page: *mut ffi::sqlite3_pcache_page,
    discard: c_int,
) {
    // SAFETY: as `cache_size`.
    unsafe { call!(xUnpin(ours(cache).inner, page, discard)) }
}

unsafe extern "C" fn rekey(
    cache: *mut ffi::sqlite3_pcache,
    page: *mut ffi::sqlite3_pcache_page,
    old_key: c_uint,
    new_key: c_uint,
) {
    // SAFETY: as `cache_size`.
    unsafe {
        let cache = ours(cache);
        call!(xRekey(cache.inner, page, old_key, new_key));
        if old_key == cache.lock_page {
            // (A page fetched there, not rekeyed there, is in `max_key`.)
            cache.at_lock_page = cache.at_lock_page.saturating_sub(1);
        }
        if new_key == cache.lock_page {
            #[cfg(test)]
            tests::count_lock_page_rekey();
            cache.at_lock_page = cache.at_lock_page.saturating_add(1);
        } else if new_key > cache.max_key {
            cache.max_key = new_key;
        }
    }
}

unsafe extern "C" fn truncate(cache: *mut ffi::sqlite3_pcache, limit: c_uint) {
    // SAFETY: as `cache_size`.
    unsafe {
        let cache = ours(cache);
        if cache.at_lock_page == 0 && limit > cache.max_key {
            // No page at `limit` or above: nothing to drop.
            #[cfg(test)]
            tests::count(true);
            return;
        }
        #[cfg(test)]
        tests::count(false);
        call!(xTruncate(cache.inner, limit));
        cache.max_key = cache.max_key.min(limit.saturating_sub(1));
        if limit <= cache.lock_page {
            cache.at_lock_page = 0;
        }
    }
}

unsafe extern "C" fn destroy(cache: *mut ffi::sqlite3_pcache) {
    // SAFETY: `cache` came from `create` and SQLite never uses it again.
    unsafe {
        let cache = Box::from_raw(cache.cast::<Cache>());
        call!(xDestroy(cache.inner));
    }
}

unsafe extern "C" fn shrink(cache: *mut ffi::sqlite3_pcache) {
    // SAFETY: as `cache_size`.
    unsafe { call!(xShrink(ours(cache).inner)) }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use sqlx::{Connection, SqliteConnection};

    use super::super::raw::Statements;
    use crate::sql::plan::{Arg, Sql};

    thread_local! {
        /// This thread's truncations, skipped and forwarded: per thread,
        /// so tests running side by side do not mix counts.
        static TRUNCATIONS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
        /// This thread's rekeys to the lock page's number.
        static LOCK_PAGE_REKEYS: Cell<u64> = const { Cell::new(0) };
    }

    pub(super) fn count_lock_page_rekey() {
        LOCK_PAGE_REKEYS.with(|n| n.set(n.get() + 1));
    }

    pub(super) fn count(skipped: bool) {
        TRUNCATIONS.with(|t| {
            let (s, f) = t.get();
            t.set(if skipped { (s + 1, f) } else { (s, f + 1) });
        });
    }

    fn truncations() -> (u64, u64) {
        TRUNCATIONS.with(Cell::get)
    }

    /// A key that lands anywhere in the index, so inserts split pages
    /// all over it (as contract ids do).
    fn scattered(n: u64) -> [u8; 32] {
        let mut key = [0u8; 32];
        let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for chunk in key.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        key
    }

    /// Runs `rows` inserts from `next` and then `end` (COMMIT or
    /// ROLLBACK) on this thread, and says how its truncations went.
    async fn transaction(
        writer: &mut SqliteConnection,
        statements: &mut Statements,
        next: &mut u64,
        rows: u64,
        value: &[u8],
        end: &'static str,
    ) -> (u64, u64) {
        let mut handle = writer.lock_handle().await.unwrap();
        let keys: Vec<[u8; 32]> = (0..rows)
            .map(|_| {
                *next += 1;
                scattered(*next)
            })
            .collect();
        let mut sql = Sql::default();
        sql.statement("BEGIN IMMEDIATE");
        for key in &keys {
            sql.bound(
                "INSERT INTO t (k, v) VALUES ($1, $2)",
                [Arg::Blob(key), Arg::Blob(value)],
            );
        }
        sql.statement(end);
        let (s0, f0) = truncations();
        statements.run(&mut handle, &sql).unwrap();
        let (s1, f1) = truncations();
        (s1 - s0, f1 - f0)
    }

    async fn rows(conn: &mut SqliteConnection) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM t")
            .fetch_one(conn)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn commits_skip_the_needless_scan_and_a_rollback_still_truncates() {
        let dir = tempfile::tempdir().unwrap();
        let connect = super::super::connect_options(&dir.path().join("p.sqlite3")).unwrap();
        let mut writer = SqliteConnection::connect_with(&connect).await.unwrap();
        sqlx::query("CREATE TABLE t (id INTEGER PRIMARY KEY, k BLOB NOT NULL UNIQUE, v BLOB)")
            .execute(&mut writer)
            .await
            .unwrap();
        let mut reader = SqliteConnection::connect_with(&connect).await.unwrap();
        let mut statements = Statements::default();
        let value = vec![3u8; 200];
        let (mut next, mut skipped) = (0, 0);
        for _ in 0..40 {
            let (s, f) = transaction(
                &mut writer,
                &mut statements,
                &mut next,
                50,
                &value,
                "COMMIT",
            )
            .await;
            skipped += s;
            // A commit's truncation drops nothing: the database only grew.
            assert_eq!(f, 0, "a commit forwarded a truncation");
        }
        // Splits borrowed the lock page's number; without the wrapper
        // every commit after one scanned the whole cache.
        assert!(
            LOCK_PAGE_REKEYS.with(Cell::get) > 0,
            "no balance borrowed the lock page's number"
        );
        assert!(skipped > 0, "no truncation was skipped");
        assert_eq!(rows(&mut reader).await, 2_000);
        // A rollback of a transaction that grew the database: its
        // truncation to the old end has pages above it, so it is
        // forwarded (SQLite has dropped most of them already).
        let mut undone = next;
        let (_, forwarded) = transaction(
            &mut writer,
            &mut statements,
            &mut undone,
            3_000,
            &value,
            "ROLLBACK",
        )
        .await;
        assert!(forwarded > 0, "the rollback's truncation was skipped");
        // The database grows again over the same page numbers.
        for _ in 0..20 {
            transaction(
                &mut writer,
                &mut statements,
                &mut next,
                150,
                &value,
                "COMMIT",
            )
            .await;
        }
        let mut handle = writer.lock_handle().await.unwrap();
        statements.finalize_all(&mut handle);
        drop(handle);
        assert_eq!(rows(&mut reader).await, 5_000);
        assert_eq!(rows(&mut writer).await, 5_000);
        let check: String = sqlx::query_scalar("PRAGMA integrity_check")
            .fetch_one(&mut writer)
            .await
            .unwrap();
        assert_eq!(check, "ok");
    }
}

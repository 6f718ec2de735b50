//! A SQLite VFS (`broker-gather`) that hands every call to the default
//! VFS, except the WAL writes of the writer's COMMIT on its own thread
//! (`during`): SQLite writes each WAL frame as two `pwrite`s (its 24-byte
//! header, then its page), each a syscall, a page-cache lookup and a copy
//! (about 20 µs of the writer's kernel time a delegation, BENCHMARKS.md).
//! Here a commit's frames are gathered in memory and written with one
//! call when its commit frame is complete — still inside SQLite's write
//! of the frames, so a failed write fails the COMMIT as before, and before
//! SQLite publishes the commit in the wal-index, so no reader (which reads
//! the WAL through its own file handle) can see a frame not yet written.
//!
//! What keeps it sound:
//! - only a thread inside `during` gathers, and `during` drops anything
//!   left when it ends (a commit's frames are written before it returns;
//!   what a failed COMMIT left, SQLite writes again): outside it no bytes
//!   are held, so a file closed or used by another thread never has any;
//! - only new frames are held (writes from where the WAL has reached on):
//!   a frame's header rewritten in place after a spill goes straight
//!   through, so its failure fails the COMMIT as before;
//! - every other call on a file that holds bytes (a read, sync, truncate,
//!   size, file control, close) writes them first, so SQLite never sees
//!   the file without its own writes;
//! - the database file's `xShmBarrier`, which SQLite calls between the two
//!   copies of the wal-index header it publishes a commit with, writes any
//!   bytes this thread still holds first. SQLite's frame writes end at the
//!   commit frame's page, so nothing is held then; if something were and
//!   could not be written, the process stops rather than publish a commit
//!   whose frames are not in the file.

use std::cell::Cell;
use std::ffi::{CStr, c_int, c_void};
use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, Ordering};

use libsqlite3_sys as ffi;

use crate::limits::sqlite::{KEPT_GATHER_BYTES, MAX_GATHERED_BYTES, MAX_WRITE_BYTES};

/// The VFS's name, for `SqliteConnectOptions::vfs`.
pub(super) const VFS_NAME: &str = "broker-gather";
const VFS_NAME_C: &CStr = c"broker-gather";
/// The WAL file's header, written at offset 0 when the WAL (re)starts.
const WAL_HEADER_BYTES: i64 = 32;
/// A frame's header; bytes 4..8 hold, for a commit frame only, the
/// database's size in pages (never zero).
const FRAME_HEADER_BYTES: usize = 24;

thread_local! {
    /// Whether this thread is inside `during`.
    static GATHERING: Cell<bool> = const { Cell::new(false) };
    /// The file holding this thread's gathered bytes, if any.
    static HOLDER: Cell<*mut File> = const { Cell::new(ptr::null_mut()) };
}

/// The default VFS this one hands its calls to.
static INNER: AtomicPtr<ffi::sqlite3_vfs> = AtomicPtr::new(ptr::null_mut());

/// A file of this VFS: SQLite allocates `szOsFile` bytes for it; the
/// default VFS's own file follows at `INNER_OFFSET`.
#[repr(C)]
struct File {
    /// SQLite's view: first, as SQLite casts the pointer.
    base: ffi::sqlite3_file,
    /// The default VFS's file.
    inner: *mut ffi::sqlite3_file,
    /// A WAL file (only those gather).
    wal: bool,
    /// Bytes gathered, to be written at `at`.
    held: Vec<u8>,
    at: i64,
    /// The last write was a commit frame's header: its page ends the
    /// commit's frames.
    commit_next: bool,
    /// Where the WAL's writes have reached since it last started: only
    /// writes from here on (new frames) are held; one below it (a frame's
    /// header rewritten in place, `walRewriteChecksums`) goes straight
    /// through, so its failure fails the COMMIT.
    reached: i64,
}

const INNER_OFFSET: usize = size_of::<File>().next_multiple_of(16);

/// Registers the VFS once (not as the default), after installing the
/// store's page cache (`pcache`); later calls answer the first one's
/// outcome.
pub(super) fn register() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    // SAFETY: SQLite's registry is thread-safe; the registered object is
    // leaked, so it outlives every connection.
    REGISTERED
        .get_or_init(|| unsafe { register_once() })
        .clone()
}

unsafe fn register_once() -> Result<(), String> {
    // The page cache can only be chosen before SQLite initializes, which
    // the VFS lookup below does.
    if !super::pcache::install() {
        tracing::warn!(
            "SQLite was initialized before the store: its default page cache serves, \
             which rescans itself at most commits while the database is under 1 GiB"
        );
    }
    // SAFETY (whole body): `sqlite3_vfs_find` initializes SQLite and
    // returns a registered VFS that lives as long as the process.
    unsafe {
        let inner = ffi::sqlite3_vfs_find(ptr::null());
        if inner.is_null() {
            return Err("SQLite has no default VFS".into());
        }
        INNER.store(inner, Ordering::Release);
        // Its other methods, and their data, are the default VFS's: they
        // take the VFS only for what they copy here (`pAppData`,
        // `mxPathname`).
        let mut vfs = ptr::read(inner);
        let own = c_int::try_from(INNER_OFFSET).map_err(|e| e.to_string())?;
        vfs.szOsFile = own
            .checked_add((*inner).szOsFile)
            .ok_or("the default VFS's files are too large")?;
        vfs.zName = VFS_NAME_C.as_ptr();
        vfs.pNext = ptr::null_mut();
        vfs.xOpen = Some(open);
        let rc = ffi::sqlite3_vfs_register(Box::into_raw(Box::new(vfs)), 0);
        if rc != ffi::SQLITE_OK {
            return Err(format!("registering the {VFS_NAME} VFS: SQLite said {rc}"));
        }
        Ok(())
    }
}

/// Runs `f` (a COMMIT stepped on this thread) with the WAL's writes
/// gathered. A commit's frames are written before it is published, so
/// nothing is held when `f` returns; if anything were (a COMMIT that
/// failed after writing its frames), it is dropped: SQLite writes a
/// failed commit's frames again when it commits them.
pub(super) fn during<T>(f: impl FnOnce() -> T) -> T {
    let _gathering = Gathering::start();
    f()
}

/// This thread gathers while it lives; when it ends, even by a panic,
/// the thread stops gathering and drops what it holds, so nothing is
/// ever held outside `during`.
struct Gathering;

impl Gathering {
    fn start() -> Self {
        GATHERING.with(|g| g.set(true));
        Self
    }
}

impl Drop for Gathering {
    fn drop(&mut self) {
        GATHERING.with(|g| g.set(false));
        let holder = HOLDER.with(|h| h.replace(ptr::null_mut()));
        if !holder.is_null() {
            #[cfg(test)]
            tests::count(tests::Place::Dropped);
            // SAFETY: a holder is open (`close` writes and clears it) and
            // this thread's (`HOLDER` is thread-local).
            let file = unsafe { &mut *holder };
            file.held.clear();
            file.commit_next = false;
        }
    }
}

/// Writes the bytes this thread holds, if any.
fn write_held() -> c_int {
    let holder = HOLDER.with(|h| h.replace(ptr::null_mut()));
    if holder.is_null() {
        return ffi::SQLITE_OK;
    }
    // SAFETY: a file is only a holder while it is open and its bytes are
    // held (`close` and `write_out` clear it first), on this thread.
    unsafe { write_out(&mut *holder) }
}

/// Writes `file`'s held bytes with one call to the default VFS (a few,
/// past `MAX_WRITE_BYTES`).
unsafe fn write_out(file: &mut File) -> c_int {
    if file.held.is_empty() {
        return ffi::SQLITE_OK;
    }
    HOLDER.with(|h| {
        if h.get() == ptr::from_mut(file) {
            h.set(ptr::null_mut());
        }
    });
    let mut rc = ffi::SQLITE_OK;
    let mut at = file.at;
    for chunk in file.held.chunks(MAX_WRITE_BYTES) {
        // SAFETY: `inner` is the open default-VFS file; `chunk` is alive
        // for the call.
        rc = unsafe { pass_write_to(file.inner, chunk, at) };
        if rc != ffi::SQLITE_OK {
            break;
        }
        at = at.saturating_add(i64::try_from(chunk.len()).unwrap_or(i64::MAX));
    }
    file.held.clear();
    if file.held.capacity() > KEPT_GATHER_BYTES {
        // After a rare large commit, not kept for the connection's life.
        file.held = Vec::new();
    }
    file.commit_next = false;
    rc
}

/// Adds a write to `file`'s held bytes; writes them when the commit's
/// frames are complete. Anything that does not extend them (a frame
/// rewritten in place) writes them first and goes straight through.
///
/// # Safety
/// `raw` is SQLite's pointer to the open file `file` borrows.
unsafe fn gather(raw: *mut File, file: &mut File, bytes: &[u8], offset: i64) -> c_int {
    let held = i64::try_from(file.held.len()).unwrap_or(i64::MAX);
    let extends = !file.held.is_empty() && offset == file.at.saturating_add(held);
    if !extends || file.held.len().saturating_add(bytes.len()) > MAX_GATHERED_BYTES {
        // SAFETY: `file` is open.
        let rc = unsafe { write_out(file) };
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        if !(starts_anew(bytes, offset) && offset >= file.reached) {
            // SAFETY: `file` is open.
            return unsafe { pass_write(file, bytes, offset) };
        }
        // This thread holds one file's bytes at a time.
        let rc = write_held();
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        file.at = offset;
        // SQLite's own pointer, not one made from this borrow.
        HOLDER.with(|h| h.set(raw));
    }
    file.held.extend_from_slice(bytes);
    let end = offset.saturating_add(i64::try_from(bytes.len()).unwrap_or(0));
    file.reached = file.reached.max(end);
    let completes = file.commit_next && bytes.len() != FRAME_HEADER_BYTES;
    file.commit_next = bytes.len() == FRAME_HEADER_BYTES && bytes[4..8] != [0; 4];
    if completes {
        #[cfg(test)]
        tests::count(tests::Place::CommitFrame);
        // SAFETY: `file` is open.
        return unsafe { write_out(file) };
    }
    ffi::SQLITE_OK
}

/// Whether a write may begin a run of held bytes: a frame's header or
/// the WAL's own.
fn starts_anew(bytes: &[u8], offset: i64) -> bool {
    bytes.len() == FRAME_HEADER_BYTES && offset >= WAL_HEADER_BYTES
        || usize::try_from(WAL_HEADER_BYTES) == Ok(bytes.len()) && offset == 0
}

unsafe fn pass_write(file: &mut File, bytes: &[u8], offset: i64) -> c_int {
    let end = offset.saturating_add(i64::try_from(bytes.len()).unwrap_or(0));
    file.reached = file.reached.max(end);
    #[cfg(test)]
    if file.wal && GATHERING.with(Cell::get) {
        tests::count(tests::Place::Through);
    }
    // SAFETY: the caller's: `file` is open.
    unsafe { pass_write_to(file.inner, bytes, offset) }
}

/// One write through the default VFS.
///
/// # Safety
/// `inner` is an open file of the default VFS.
unsafe fn pass_write_to(inner: *mut ffi::sqlite3_file, bytes: &[u8], offset: i64) -> c_int {
    let Ok(amount) = c_int::try_from(bytes.len()) else {
        return ffi::SQLITE_TOOBIG;
    };
    // SAFETY: the caller's; `bytes` is alive for the call.
    match unsafe { (*(*inner).pMethods).xWrite } {
        Some(write) => unsafe { write(inner, bytes.as_ptr().cast(), amount, offset) },
        None => ffi::SQLITE_IOERR_WRITE,
    }
}

unsafe extern "C" fn open(
    _vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    // SAFETY (whole body): SQLite gives `szOsFile` writable bytes at
    // `file`, uninitialized; the default VFS's file fits after ours.
    unsafe {
        let inner_vfs = INNER.load(Ordering::Acquire);
        let inner = file
            .cast::<u8>()
            .add(INNER_OFFSET)
            .cast::<ffi::sqlite3_file>();
        (*inner).pMethods = ptr::null();
        let this = file.cast::<File>();
        ptr::write(
            this,
            File {
                base: ffi::sqlite3_file {
                    pMethods: ptr::null(),
                },
                inner,
                wal: flags & ffi::SQLITE_OPEN_WAL != 0,
                held: Vec::new(),
                at: 0,
                commit_next: false,
                reached: 0,
            },
        );
        let Some(inner_open) = (*inner_vfs).xOpen else {
            ptr::drop_in_place(this);
            return ffi::SQLITE_CANTOPEN;
        };
        let rc = inner_open(inner_vfs, name, inner, flags, out_flags);
        if (*inner).pMethods.is_null() {
            // SQLite will not close it: drop ours now.
            ptr::drop_in_place(this);
        } else {
            let methods = &*(*inner).pMethods;
            let shared = methods.iVersion >= 3 && methods.xShmMap.is_some();
            (*this).base.pMethods = if shared { &METHODS } else { &PLAIN_METHODS };
        }
        rc
    }
}

/// The file behind SQLite's pointer, and the default VFS's methods.
///
/// # Safety
/// `file` is an open file of this VFS.
unsafe fn parts<'f>(file: *mut ffi::sqlite3_file) -> (&'f mut File, &'f ffi::sqlite3_io_methods) {
    // SAFETY: the caller's; an open file has the default VFS's methods.
    unsafe {
        let this = &mut *file.cast::<File>();
        let methods = &*(*this.inner).pMethods;
        (this, methods)
    }
}

/// Forwards a call after writing what `file` holds (any call that could
/// observe the file's contents or size).
macro_rules! after_writing {
    ($file:ident, $method:ident $(, $arg:expr)*) => {{
        // SAFETY: SQLite calls methods of open files only.
        let (this, methods) = unsafe { parts($file) };
        let rc = unsafe { write_out(this) };
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        match methods.$method {
            Some(method) => unsafe { method(this.inner $(, $arg)*) },
            None => ffi::SQLITE_IOERR,
        }
    }};
}

/// Forwards a call that cannot observe the file's contents.
macro_rules! forward {
    ($file:ident, $method:ident $(, $arg:expr)*) => {{
        // SAFETY: SQLite calls methods of open files only.
        let (this, methods) = unsafe { parts($file) };
        match methods.$method {
            Some(method) => unsafe { method(this.inner $(, $arg)*) },
            None => ffi::SQLITE_IOERR,
        }
    }};
}

unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes an open file once.
    unsafe {
        let (this, methods) = parts(file);
        let written = write_out(this);
        let rc = match methods.xClose {
            Some(close) => close(this.inner),
            None => ffi::SQLITE_OK,
        };
        ptr::drop_in_place(file.cast::<File>());
        if written != ffi::SQLITE_OK {
            written
        } else {
            rc
        }
    }
}

unsafe extern "C" fn read(
    file: *mut ffi::sqlite3_file,
    buffer: *mut c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    after_writing!(file, xRead, buffer, amount, offset)
}

unsafe extern "C" fn write(
    file: *mut ffi::sqlite3_file,
    buffer: *const c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite passes `amount` readable bytes at `buffer`.
    unsafe {
        let (this, _) = parts(file);
        let bytes =
            std::slice::from_raw_parts(buffer.cast::<u8>(), usize::try_from(amount).unwrap_or(0));
        if this.wal && offset == 0 {
            // The WAL starts again from its header: every frame is new.
            this.reached = 0;
        }
        if this.wal && GATHERING.with(Cell::get) {
            return gather(file.cast::<File>(), this, bytes, offset);
        }
        let rc = write_out(this);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        pass_write(this, bytes, offset)
    }
}

unsafe extern "C" fn truncate(file: *mut ffi::sqlite3_file, size: ffi::sqlite3_int64) -> c_int {
    // SAFETY: SQLite calls methods of open files only.
    let (this, _) = unsafe { parts(file) };
    this.reached = this.reached.min(size);
    after_writing!(file, xTruncate, size)
}

unsafe extern "C" fn sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    after_writing!(file, xSync, flags)
}

unsafe extern "C" fn file_size(
    file: *mut ffi::sqlite3_file,
    size: *mut ffi::sqlite3_int64,
) -> c_int {
    after_writing!(file, xFileSize, size)
}

unsafe extern "C" fn lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    forward!(file, xLock, level)
}

unsafe extern "C" fn unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    forward!(file, xUnlock, level)
}

unsafe extern "C" fn check_reserved_lock(file: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    forward!(file, xCheckReservedLock, out)
}

unsafe extern "C" fn file_control(
    file: *mut ffi::sqlite3_file,
    op: c_int,
    arg: *mut c_void,
) -> c_int {
    after_writing!(file, xFileControl, op, arg)
}

unsafe extern "C" fn sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    forward!(file, xSectorSize)
}

unsafe extern "C" fn device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    forward!(file, xDeviceCharacteristics)
}

unsafe extern "C" fn shm_map(
    file: *mut ffi::sqlite3_file,
    region: c_int,
    size: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    forward!(file, xShmMap, region, size, extend, out)
}

unsafe extern "C" fn shm_lock(
    file: *mut ffi::sqlite3_file,
    offset: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    forward!(file, xShmLock, offset, n, flags)
}

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    #[cfg(test)]
    if !HOLDER.with(Cell::get).is_null() {
        tests::count(tests::Place::Barrier);
    }
    if write_held() != ffi::SQLITE_OK {
        // A commit is about to be published whose frames are not all in
        // the WAL: readers would read what was never written.
        eprintln!(
            "{VFS_NAME}: the WAL's gathered frames could not be written before a commit was published; stopping"
        );
        std::process::abort();
    }
    // SAFETY: SQLite calls methods of open files only.
    let (this, methods) = unsafe { parts(file) };
    if let Some(barrier) = methods.xShmBarrier {
        unsafe { barrier(this.inner) }
    }
}

unsafe extern "C" fn shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    forward!(file, xShmUnmap, delete)
}

unsafe extern "C" fn fetch(
    file: *mut ffi::sqlite3_file,
    offset: ffi::sqlite3_int64,
    amount: c_int,
    out: *mut *mut c_void,
) -> c_int {
    after_writing!(file, xFetch, offset, amount, out)
}

unsafe extern "C" fn unfetch(
    file: *mut ffi::sqlite3_file,
    offset: ffi::sqlite3_int64,
    page: *mut c_void,
) -> c_int {
    forward!(file, xUnfetch, offset, page)
}

/// For a file whose default-VFS methods have no shared memory or are of
/// an older version (none on Linux today: its unix VFS gives every file
/// version 3): SQLite asks neither shared memory nor mapped reads of it.
static PLAIN_METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 1,
    xShmMap: None,
    xShmLock: None,
    xShmBarrier: None,
    xShmUnmap: None,
    xFetch: None,
    xUnfetch: None,
    ..METHODS
};

/// Version 3: shared memory and memory-mapped reads, as the default VFS's
/// database files.
static METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(close),
    xRead: Some(read),
    xWrite: Some(write),
    xTruncate: Some(truncate),
    xSync: Some(sync),
    xFileSize: Some(file_size),
    xLock: Some(lock),
    xUnlock: Some(unlock),
    xCheckReservedLock: Some(check_reserved_lock),
    xFileControl: Some(file_control),
    xSectorSize: Some(sector_size),
    xDeviceCharacteristics: Some(device_characteristics),
    xShmMap: Some(shm_map),
    xShmLock: Some(shm_lock),
    xShmBarrier: Some(shm_barrier),
    xShmUnmap: Some(shm_unmap),
    xFetch: Some(fetch),
    xUnfetch: Some(unfetch),
};

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashMap;

    use sqlx::sqlite::SqliteConnectOptions;
    use sqlx::{Connection, SqliteConnection};

    use super::super::raw::Statements;
    use crate::sql::plan::{Arg, Sql};

    /// Where held bytes were written (or dropped), or a write went
    /// straight through while gathering.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub(super) enum Place {
        /// When the commit frame was complete: before SQLite publishes.
        CommitFrame,
        /// At the wal-index barrier: they should never get that far.
        Barrier,
        /// Dropped at the end of `during`.
        Dropped,
        /// A write below what the WAL reached (a rewrite in place).
        Through,
    }

    thread_local! {
        /// Per thread, so tests running side by side do not mix counts.
        static COUNTS: RefCell<HashMap<Place, u64>> = RefCell::new(HashMap::new());
    }

    pub(super) fn count(place: Place) {
        COUNTS.with(|c| *c.borrow_mut().entry(place).or_default() += 1);
    }

    fn counts() -> HashMap<Place, u64> {
        COUNTS.with(|c| c.take())
    }

    const COMMITS: i64 = 40;
    const ROWS: i64 = 8;
    /// Rows of each big commit: more frames than `MAX_GATHERED_BYTES`
    /// (with a page cache that holds them all until COMMIT), then more
    /// than a small page cache holds (SQLite spills frames before COMMIT
    /// and rewrites some of them in place at COMMIT).
    const BIG_ROWS: i64 = 3_000;

    fn with_wal(path: &std::path::Path) -> std::path::PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push("-wal");
        name.into()
    }

    async fn count_rows(conn: &mut SqliteConnection, value: &[u8]) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM t WHERE v = $1")
            .bind(value)
            .fetch_one(conn)
            .await
            .unwrap()
    }

    async fn pragma(conn: &mut SqliteConnection, text: &'static str) {
        sqlx::query(text).execute(conn).await.unwrap();
    }

    /// Commits `rows` rows from `key` on the writer's statements, then
    /// says where its held bytes went.
    async fn commit(
        writer: &mut SqliteConnection,
        statements: &mut Statements,
        key: &mut i64,
        rows: i64,
        value: &[u8],
    ) -> HashMap<Place, u64> {
        let mut handle = writer.lock_handle().await.unwrap();
        let mut sql = Sql::default();
        sql.statement("BEGIN IMMEDIATE");
        for _ in 0..rows {
            *key += 1;
            sql.bound(
                "INSERT INTO t (k, v) VALUES ($1, $2)",
                [Arg::Int(*key), Arg::Blob(value)],
            );
        }
        sql.statement("COMMIT");
        counts();
        statements.run(&mut handle, &sql).unwrap();
        counts()
    }

    /// The rest of a commit went out once, when its commit frame was
    /// complete; nothing was left for the barrier or dropped.
    fn assert_written_at_the_commit_frame(places: &HashMap<Place, u64>) {
        assert_eq!(places.get(&Place::CommitFrame), Some(&1), "{places:?}");
        assert_eq!(places.get(&Place::Barrier), None, "{places:?}");
        assert_eq!(places.get(&Place::Dropped), None, "{places:?}");
    }

    #[tokio::test]
    async fn a_commits_frames_are_written_before_it_is_published_and_read_back_everywhere() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gather.sqlite3");
        let connect = super::super::connect_options(&path).unwrap();
        let mut writer = SqliteConnection::connect_with(&connect).await.unwrap();
        pragma(
            &mut writer,
            "CREATE TABLE t (k INTEGER PRIMARY KEY, v BLOB NOT NULL)",
        )
        .await;
        let mut reader = SqliteConnection::connect_with(&connect).await.unwrap();
        let value = vec![7u8; 3_000];
        let mut statements = Statements::default();
        let (mut key, mut all) = (0, 0);
        let once = HashMap::from([(Place::CommitFrame, 1)]);
        for round in 0..COMMITS {
            if round == COMMITS / 2 {
                // The WAL starts again from its header at the next commit.
                pragma(&mut reader, "PRAGMA wal_checkpoint(TRUNCATE)").await;
            }
            let places = commit(&mut writer, &mut statements, &mut key, ROWS, &value).await;
            assert_eq!(
                places, once,
                "commit {round}: written once, at its commit frame"
            );
            all += ROWS;
            // Another connection, reading the WAL through its own file.
            assert_eq!(count_rows(&mut reader, &value).await, all);
        }
        pragma(&mut writer, "PRAGMA cache_size = -65536").await;
        let places = commit(&mut writer, &mut statements, &mut key, BIG_ROWS, &value).await;
        // Over the bound: what was held goes out, the page that did not
        // fit straight after it, and the rest at the commit frame.
        assert_written_at_the_commit_frame(&places);
        all += BIG_ROWS;
        assert_eq!(count_rows(&mut reader, &value).await, all);
        pragma(&mut writer, "PRAGMA cache_size = -1024").await;
        let places = commit(&mut writer, &mut statements, &mut key, BIG_ROWS, &value).await;
        // Spilled: frames rewritten in place went straight through.
        assert_written_at_the_commit_frame(&places);
        assert!(
            places.get(&Place::Through).is_some_and(|n| *n > 0),
            "{places:?}"
        );
        all += BIG_ROWS;
        assert_eq!(count_rows(&mut reader, &value).await, all);
        let mut handle = writer.lock_handle().await.unwrap();
        statements.finalize_all(&mut handle);
        drop(handle);
        assert_eq!(count_rows(&mut writer, &value).await, all);
        // A crash now: the database and its WAL as they are, opened
        // elsewhere; SQLite rebuilds its index from the WAL's frames,
        // checking every frame's checksum, and keeps only whole commits.
        let crashed = dir.path().join("crashed.sqlite3");
        std::fs::copy(&path, &crashed).unwrap();
        std::fs::copy(with_wal(&path), with_wal(&crashed)).unwrap();
        let mut recovered =
            SqliteConnection::connect_with(&SqliteConnectOptions::new().filename(&crashed))
                .await
                .unwrap();
        assert_eq!(count_rows(&mut recovered, &value).await, all);
        let check: String = sqlx::query_scalar("PRAGMA integrity_check")
            .fetch_one(&mut recovered)
            .await
            .unwrap();
        assert_eq!(check, "ok");
    }
}

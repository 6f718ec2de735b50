//! Watch across replicas: the outbox's commit-order positions and the
//! cursors made from them.
//!
//! Every transaction writes one `events` row per contract or receipt it
//! numbered, with its position: as its last step it takes the
//! `event_clock` row lock (`FOR UPDATE`: the row itself never changes),
//! gives its events the next positions of the `event_positions` sequence
//! in `seq` order and holds the lock until it commits (`place_own`; an
//! issuance does the same as the last part of its one write statement,
//! `unnest::writes`). Only holders of that lock take positions, so
//! positions become visible in the order they were given, whole
//! transactions at a time, and none is given between: a reader that has
//! seen position n has seen every event placed before it, and never misses
//! one placed later. A child's event is never placed before its parent's:
//! the child's transaction locked the parent after the parent committed.
//! The lock is taken after every contract lock, so its holder never waits
//! for another lock (no cycle), and it is held only for the commit.
//! A sequencer per replica announces positions given through other
//! replicas to this replica's Watch streams (every `SEQUENCER_POLL`). No
//! writer leaves an event unplaced; a database written by an earlier
//! version (whose sequencer placed every event after commit) may hold
//! some, and each replica's sequencer places them when it starts, trying
//! again until it has (`place_leftovers`). Replicas of that older version
//! should be stopped before this one starts: events they write later are
//! placed only when a replica starts again. Replicas from before
//! migration 39 (which gave positions from the clock row's `last_pos`)
//! must be stopped too: migration 41 drops that column, so their every
//! write fails rather than give positions that would collide with the
//! sequence's — theirs at first, the newer replicas' once theirs ran
//! ahead (`events.pos` is unique: refused, never misordered).
//!
//! A cursor is `tag << 48 | position`: the tag, random per database (see
//! the `event_clock` migration), makes a cursor from another database fail
//! loudly instead of skipping or repeating events.

use super::*;
use crate::limits::postgres::{MAX_PLACED_PER_PASS, MAX_SEQUENCER_PAUSE, SEQUENCER_POLL};

/// Bits of a cursor that hold the position (2^48 events per database).
const POSITION_BITS: u32 = 48;
const POSITION_MASK: i64 = (1 << POSITION_BITS) - 1;

/// This database's cursor tag.
pub(super) async fn tag(pool: &PgPool) -> Result<i64, StoreError> {
    let tag: i64 = sqlx::query_scalar("SELECT tag FROM event_clock WHERE id = 1")
        .fetch_one(pool)
        .await
        .map_err(backend)?;
    if !(1..1 << 15).contains(&tag) {
        return Err(StoreError::Corrupt(format!("event_clock tag {tag}")));
    }
    Ok(tag)
}

fn cursor_of(tag: i64, position: i64) -> i64 {
    tag << POSITION_BITS | (position & POSITION_MASK)
}

/// The position a client's cursor stands for; a cursor from another
/// database is refused.
fn position_of(tag: i64, cursor: i64) -> Result<i64, StoreError> {
    if cursor == 0 {
        return Ok(0);
    }
    if cursor >> POSITION_BITS != tag {
        return Err(StoreError::Invalid(broker_domain::InputError::new(
            "cursor",
            "was not issued by this broker's database (a cursor from another deployment)",
        )));
    }
    Ok(cursor & POSITION_MASK)
}

/// Signed events of the subtree under `contract` after `cursor`, in
/// commit order (see the module docs).
pub(super) async fn events(
    store: &PostgresStore,
    contract: Id,
    cursor: i64,
    limit: u32,
    max_bytes: usize,
) -> Result<Vec<Event>, StoreError> {
    let after = position_of(store.tag, cursor)?;
    let mut conn = store.sql.read().await?;
    let mut rows = sqlx::query(
        "WITH RECURSIVE sub(seq) AS (\
             SELECT seq FROM contracts WHERE id = $1 \
             UNION ALL SELECT c.seq FROM contracts c JOIN sub ON c.parent_seq = sub.seq) \
         SELECT e.pos AS position, e.kind, COALESCE(ce.envelope, r.envelope) AS envelope \
         FROM events e \
             LEFT JOIN contract_envelopes ce ON e.kind = 1 AND ce.seq = e.seq \
             LEFT JOIN receipts r ON e.kind = 2 AND r.seq = e.seq \
         WHERE e.pos > $2 AND e.contract_seq IN (SELECT seq FROM sub) \
         ORDER BY e.pos LIMIT $3",
    )
    .bind(contract.as_slice())
    .bind(after)
    .bind(i64::from(limit))
    .fetch(&mut *conn);
    crate::sql::reads::collect_events::<sqlx::Postgres>(
        &mut rows,
        |position| cursor_of(store.tag, position),
        max_bytes,
    )
    .await
}

/// Announces the positions other replicas gave to this replica's Watch
/// streams every `SEQUENCER_POLL`, and reports whether the database
/// answers (health); stops when the store is gone.
pub(super) async fn sequencer(
    pool: PgPool,
    tag: i64,
    trees: crate::TreeChanges,
    commits: Arc<tokio::sync::watch::Sender<u64>>,
    alive: mpsc::WeakSender<(Command, Reply)>,
    reachable: tokio::sync::watch::Sender<bool>,
    poll_timeout: Duration,
) {
    // The last committed position: positions still uncommitted are all
    // later ones (given under the clock's lock, held to commit).
    let mut seen = match sqlx::query_scalar::<_, i64>("SELECT COALESCE(MAX(pos), 0) FROM events")
        .fetch_one(&pool)
        .await
    {
        Ok(last) => last,
        Err(e) => {
            tracing::warn!(error = %e, "reading the last event position; announcing from the start");
            0
        }
    };
    // Longer while the database is away: a replica must not hammer a
    // database that is down (or gone) with connection attempts.
    let mut pause = SEQUENCER_POLL;
    let mut leftovers_placed = place_leftovers(&pool).await;
    let mut poller: Option<PgConnection> = None;
    loop {
        tokio::time::sleep(pause).await;
        if alive.upgrade().is_none() {
            return;
        }
        if !leftovers_placed {
            leftovers_placed = place_leftovers(&pool).await;
        }
        // Bounded: a poll on a connection into a network that went
        // silent would otherwise wait for the kernel, and health with it.
        let announced = tokio::time::timeout(poll_timeout, async {
            let mut conn = match poller.take() {
                Some(conn) => conn,
                None => poll_connection(&pool).await?,
            };
            let result = announce(&mut conn, tag, &mut seen, &trees).await;
            if result.is_ok() {
                poller = Some(conn);
            }
            result
        })
        .await
        .unwrap_or(Err(sqlx::Error::PoolTimedOut));
        // Health follows the database even when nothing is written: the
        // sequencer reaches it every `SEQUENCER_POLL`.
        let up = !matches!(&announced, Err(e) if writer::unreachable(e));
        reachable.send_if_modified(|now| std::mem::replace(now, up) != up);
        pause = if up {
            SEQUENCER_POLL
        } else {
            (pause * 2).min(MAX_SEQUENCER_PAUSE)
        };
        match announced {
            Ok(true) => {
                commits.send_modify(|n| *n = n.wrapping_add(1));
            }
            Ok(false) => {}
            Err(e) => tracing::debug!(error = %e, "reading new event positions failed; will retry"),
        }
    }
}

/// The statement of `place_own`: `$1` the transaction's seqs. Its
/// events are read back from its rows, then placed as an issuance group's
/// are (`unnest::PLACE`).
pub(super) const PLACE_OWN: &str = concat!(
    "WITH ev AS (\
         SELECT seq, 1 AS kind, seq AS contract_seq, root_id FROM contracts WHERE seq = ANY($1) \
         UNION ALL \
         SELECT seq, 2, contract_seq, root_id FROM receipts WHERE seq = ANY($1)), \
     done AS (SELECT 1 AS rows), ",
    super::unnest::place!()
);

/// Places a transaction's own events (the contracts and receipts it
/// numbered, `seqs`) at the next positions, in `seq` order, under the
/// `event_clock` row lock, which the transaction then holds until it
/// commits: positions become visible in the order they were given, and
/// none is given between (see `unnest::PLACE`). Taken last, after every contract lock, so a
/// transaction holding it never waits for another lock. Returns the
/// (position, root) of each event, to announce after commit.
pub(super) async fn place_own(
    conn: &mut PgConnection,
    seqs: &[i64],
) -> Result<Vec<(i64, Vec<u8>)>, sqlx::Error> {
    if seqs.is_empty() {
        return Ok(Vec::new());
    }
    // One statement (one round trip): the clock's row lock is taken
    // after every lock the transaction's earlier statements took, and the
    // event rows get the positions taken under it.
    let placed: Vec<(i64, Vec<u8>)> = sqlx::query_as(PLACE_OWN)
        .bind(seqs)
        .fetch_all(&mut *conn)
        .await?;
    Ok(placed)
}

/// Tells this replica's Watch streams about events it placed itself.
pub(super) fn announce_own(
    tag: i64,
    trees: &crate::TreeChanges,
    commits: &tokio::sync::watch::Sender<u64>,
    placed: &[(i64, Vec<u8>)],
) {
    if placed.is_empty() {
        return;
    }
    for (position, root) in placed {
        if let Ok(root) = Id::try_from(root.as_slice()) {
            trees.touch(root, cursor_of(tag, *position));
        }
    }
    // Placed by a transaction that has committed.
    trees.committed();
    commits.send_modify(|n| *n = n.wrapping_add(1));
}

/// Places every event an earlier version left unplaced (see the module
/// docs), a pass at a time; true once none is left. A pass that loses a
/// race for the clock (or meets a database away) is left for the
/// sequencer to try again: it never keeps a replica from starting.
pub(super) async fn place_leftovers(pool: &PgPool) -> bool {
    loop {
        match place(pool).await {
            Ok(placed) if placed == MAX_PLACED_PER_PASS as usize => {}
            Ok(_) => return true,
            Err(e) => {
                tracing::warn!(error = %e, "placing events an earlier version left; will retry");
                return false;
            }
        }
    }
}

/// Gives up to `MAX_PLACED_PER_PASS` committed, unplaced events the next
/// positions, in `seq` order, in one transaction under the `event_clock`
/// row lock; returns how many.
async fn place(pool: &PgPool) -> Result<usize, sqlx::Error> {
    // The writers' pool: back to custom plans for this range read.
    let mut tx = pool.begin_with(super::writer::CUSTOM_PLANS_BEGIN).await?;
    sqlx::query("SELECT 1 FROM event_clock WHERE id = 1 FOR UPDATE")
        .execute(&mut *tx)
        .await?;
    let seqs: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM events WHERE pos IS NULL ORDER BY seq LIMIT $1")
            .bind(MAX_PLACED_PER_PASS)
            .fetch_all(&mut *tx)
            .await?;
    if seqs.is_empty() {
        tx.rollback().await?;
        return Ok(0);
    }
    // Under the lock: consecutive, after every position given so far.
    let mut positions: Vec<i64> =
        sqlx::query_scalar("SELECT nextval('event_positions') FROM generate_series(1, $1)")
            .bind(i64::try_from(seqs.len()).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await?;
    positions.sort_unstable();
    sqlx::query(
        "UPDATE events SET pos = u.pos FROM UNNEST($1::BIGINT[], $2::BIGINT[]) AS u(seq, pos) \
         WHERE events.seq = u.seq",
    )
    .bind(&seqs)
    .bind(&positions)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(seqs.len())
}

/// The sequencer's own connection, taken out of the pool and kept from
/// one poll to the next (a pooled one is checked as it goes back: a round
/// trip a poll, a hundred polls a second on every replica), with the
/// poll's one plan kept (`POLL_SETTINGS`). Closed after a failure; the
/// next poll opens another.
async fn poll_connection(pool: &PgPool) -> Result<PgConnection, sqlx::Error> {
    let mut conn = pool.acquire().await?.detach();
    sqlx::raw_sql(POLL_SETTINGS).execute(&mut conn).await?;
    Ok(conn)
}

/// The poll's connection keeps one generic plan of `POLL`, made without
/// sequential scans or sorts: down the positions' index from `$1`,
/// whatever the table's size when it was made (checked with the
/// issuance's statements by `the_issuance_statements_seek_with_generic_plans`).
pub(super) const POLL_SETTINGS: &str = "SET plan_cache_mode = force_generic_plan; \
     SET enable_seqscan = off; SET enable_sort = off";

/// The sequencer's poll: `$1` the last position seen, `$2` the most rows.
pub(super) const POLL: &str =
    "SELECT pos, root_id FROM events WHERE pos > $1 ORDER BY pos LIMIT $2";

/// Marks the trees of events placed after `seen` (by any replica) as
/// changed; true when there were any.
async fn announce(
    conn: &mut PgConnection,
    tag: i64,
    seen: &mut i64,
    trees: &crate::TreeChanges,
) -> Result<bool, sqlx::Error> {
    let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(POLL)
        .bind(*seen)
        .bind(MAX_PLACED_PER_PASS)
        .fetch_all(conn)
        .await?;
    for (position, root) in &rows {
        if let Ok(root) = Id::try_from(root.as_slice()) {
            trees.touch(root, cursor_of(tag, *position));
        }
        *seen = (*seen).max(*position);
    }
    // Read from the table: committed, by whichever replica.
    trees.committed();
    if rows.len() < MAX_PLACED_PER_PASS as usize {
        trees.polled();
    }
    Ok(!rows.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_carry_their_database() {
        let cursor = cursor_of(7, 12345);
        assert_eq!(position_of(7, cursor).unwrap(), 12345);
        assert_eq!(position_of(7, 0).unwrap(), 0);
        assert!(matches!(
            position_of(8, cursor),
            Err(StoreError::Invalid(e)) if e.field == "cursor"
        ));
        // A plain position (another backend's cursor) is refused too.
        assert!(position_of(7, 12345).is_err());
    }
}

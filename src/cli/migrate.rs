//! `migrate`: the PostgreSQL schema brought up to date, or (`--status`)
//! where it is and what is pending.

/// The exit status of `migrate --status` when migrations are pending.
pub const MIGRATIONS_PENDING_EXIT_STATUS: u8 = 3;

/// Migrations are pending (already printed): exit status 3.
#[derive(Debug, thiserror::Error)]
#[error("{0} migrations pending: run `delegation-broker migrate`")]
pub struct Pending(usize);

/// `migrate --status`: where the schema is and what is pending.
pub fn status(database_url: &str, json: bool) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (at, status) = runtime.block_on(async {
        let connect = crate::store::postgres::connect_options(database_url)?;
        let at = crate::store::postgres::describe(&connect);
        anyhow::Ok((at, crate::store::postgres::migrate::status(&connect).await?))
    })?;
    if json {
        let pending: Vec<_> = status
            .pending
            .iter()
            .map(|(version, description)| {
                serde_json::json!({"version": version, "description": description})
            })
            .collect();
        let line = serde_json::json!({
            "database": at,
            "current": status.current,
            "latest": status.latest,
            "pending": pending,
        });
        println!("{line}");
    } else {
        println!("database: {at}");
        println!("current version: {}", status.current);
        println!("latest version: {}", status.latest);
        if status.pending.is_empty() {
            println!("up to date");
        }
        for (version, description) in &status.pending {
            println!("pending: {version:04} {description}");
        }
    }
    match status.pending.len() {
        0 => Ok(()),
        pending => Err(Pending(pending).into()),
    }
}

/// `delegation-broker migrate`: the PostgreSQL schema brought up to date,
/// each migration applied printed.
pub fn run(database_url: &str) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        use crate::store::postgres::migrate;
        let connect = crate::store::postgres::connect_options(database_url)?;
        let at = crate::store::postgres::describe(&connect);
        for (version, description) in migrate::run(&connect).await? {
            println!("applied {version:04} {description}");
        }
        let status = migrate::status(&connect).await?;
        println!(
            "the database schema at {at} is at version {} (latest)",
            status.current
        );
        Ok(())
    })
}

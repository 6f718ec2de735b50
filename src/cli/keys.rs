//! `keys list|retire`: the signing-key registry of a replicated broker
//! (PostgreSQL), for operators. Every replica registers its key and
//! heartbeats it; a key whose replica went silent for
//! `limits.replica_key_ttl_ms` is retired by the others, and an operator
//! retires one for good here (a leaked key, a decommissioned replica).
//! Retired keys still verify what they signed; no session sealed with one
//! is accepted.

use clap::{Args, Subcommand};

use crate::store::postgres::migrate::{KeyRecord, retired_by};

#[derive(Args, Debug)]
pub struct KeysArgs {
    /// The shared database, e.g. postgres://broker@db:5432/broker.
    #[arg(long, env = "BROKER_DATABASE_URL", global = true)]
    database_url: Option<String>,
    #[command(subcommand)]
    command: KeysCommand,
}

#[derive(Subcommand, Debug)]
enum KeysCommand {
    /// Prints the keys a running broker publishes (GetBrokerKeys, no
    /// key file needed): key id, current or retired (since when), and the
    /// public key in hex and in base64.
    Show {
        /// Broker address, e.g. http://127.0.0.1:50051.
        #[arg(long, env = "BROKER_ADDR", default_value = "http://127.0.0.1:50051")]
        addr: String,
        /// One JSON object per key instead of text.
        #[arg(long, conflicts_with = "quiet")]
        json: bool,
        /// Only the current key, in hex (for `verify --public-key`).
        #[arg(long, short)]
        quiet: bool,
        #[command(flatten)]
        tls: super::tls::TlsArgs,
    },
    /// Lists every registered key: current or retired (when, and why:
    /// rotation, ttl, operator), its replica's last heartbeat, the public
    /// key in hex.
    List,
    /// Retires a key for good: replicas stop accepting sessions sealed
    /// with it within a second, a replica holding it cannot register it
    /// again (give it a new key), and what it signed still verifies.
    Retire {
        /// The key id, as `keys list` and GetBrokerKeys show it
        /// (`ed25519:` and 32 hex digits).
        key_id: String,
    },
}

pub fn run(args: KeysArgs) -> anyhow::Result<()> {
    if let KeysCommand::Show {
        addr,
        json,
        quiet,
        tls,
    } = &args.command
    {
        return show(addr, tls, *json, *quiet);
    }
    let url = args.database_url.ok_or_else(|| {
        anyhow::anyhow!(
            "--database-url (or BROKER_DATABASE_URL) is required: the registry is a replicated broker's; a single broker's keys are its data directory's (rotate-key)"
        )
    })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let connect = crate::store::postgres::connect_options(&url)?;
        match args.command {
            // Answered above, without the database.
            KeysCommand::Show { .. } => {}
            KeysCommand::List => {
                let keys = crate::store::postgres::migrate::list_keys(&connect).await?;
                print!("{}", table(&keys));
            }
            KeysCommand::Retire { key_id } => {
                if !valid_key_id(&key_id) {
                    anyhow::bail!(
                        "KEY_ID must be `ed25519:` and 32 hex digits (as `keys list` shows), not {:?}",
                        key_id.chars().take(80).collect::<String>()
                    );
                }
                if crate::store::postgres::migrate::retire_key(&connect, &key_id).await? {
                    println!("retired {key_id}");
                } else {
                    println!("{key_id} was already retired by an operator");
                }
            }
        }
        Ok(())
    })
}

/// `keys show`: the published keys, a line (or JSON object) each.
fn show(addr: &str, tls: &super::tls::TlsArgs, json: bool, quiet: bool) -> anyhow::Result<()> {
    use base64::Engine as _;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let keys = runtime.block_on(super::read::broker_keys(addr, tls))?;
    if quiet {
        let current = keys.iter().find(|k| k.current);
        let current =
            current.ok_or_else(|| anyhow::anyhow!("the broker published no current key"))?;
        println!("{}", hex::encode(&current.public_key));
        return Ok(());
    }
    for key in keys {
        let hex_key = hex::encode(&key.public_key);
        let base64_key = base64::engine::general_purpose::STANDARD.encode(&key.public_key);
        let state = if key.current {
            "current".to_owned()
        } else {
            format!("retired {}", super::tree::rfc3339(key.retired_at_ms))
        };
        if json {
            let line = serde_json::json!({
                "key_id": key.key_id,
                "current": key.current,
                "retired_at_ms": key.retired_at_ms.to_string(),
                "public_key_hex": hex_key,
                "public_key_base64": base64_key,
            });
            println!("{line}");
        } else {
            println!(
                "{}  {state}  hex {hex_key}  base64 {base64_key}",
                key.key_id
            );
        }
    }
    Ok(())
}

/// `ed25519:` and 32 lower-case hex digits (`crypto::key_id`).
fn valid_key_id(key_id: &str) -> bool {
    key_id.strip_prefix("ed25519:").is_some_and(|hex_part| {
        hex_part.len() == 32
            && hex_part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// One line per key under a header, columns separated by two spaces.
pub fn table(keys: &[KeyRecord]) -> String {
    let time = |ms: Option<i64>| ms.map_or_else(|| "-".to_owned(), super::tree::rfc3339);
    let mut rows = vec![[
        "KEY ID".to_owned(),
        "STATE".to_owned(),
        "REGISTERED".to_owned(),
        "LAST SEEN".to_owned(),
        "RETIRED".to_owned(),
        "BY".to_owned(),
        "PUBLIC KEY".to_owned(),
    ]];
    for key in keys {
        rows.push([
            key.key_id.clone(),
            if key.retired_at_ms.is_some() {
                "retired"
            } else {
                "current"
            }
            .to_owned(),
            time(Some(key.registered_at_ms)),
            time(key.seen_at_ms),
            time(key.retired_at_ms),
            key.retired_by.clone().unwrap_or_else(|| "-".to_owned()),
            hex::encode(&key.public_key),
        ]);
    }
    let mut widths = [0usize; 7];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<width$}  ", width = widths[i]));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

// The reasons `keys list` shows are the registry's.
const _: [&str; 3] = [retired_by::ROTATION, retired_by::TTL, retired_by::OPERATOR];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ids_are_checked_before_any_connection() {
        assert!(valid_key_id("ed25519:00112233445566778899aabbccddeeff"));
        for bad in [
            "",
            "ed25519:",
            "ed25519:00112233445566778899AABBCCDDEEFF",
            "00112233445566778899aabbccddeeff",
            "ed25519:00112233445566778899aabbccddeeff00",
        ] {
            assert!(!valid_key_id(bad), "{bad}");
        }
    }

    #[test]
    fn the_table_aligns_its_columns() {
        let keys = [
            KeyRecord {
                key_id: "ed25519:aa".into(),
                public_key: vec![1, 2],
                registered_at_ms: 0,
                seen_at_ms: Some(1_000),
                retired_at_ms: None,
                retired_by: None,
            },
            KeyRecord {
                key_id: "ed25519:bbbb".into(),
                public_key: vec![3],
                registered_at_ms: 0,
                seen_at_ms: None,
                retired_at_ms: Some(2_000),
                retired_by: Some(retired_by::TTL.into()),
            },
        ];
        let text = table(&keys);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(
            lines[1].starts_with("ed25519:aa    current  1970-01-01T00:00:00"),
            "{text}"
        );
        assert!(
            lines[2].contains("retired") && lines[2].contains("ttl"),
            "{text}"
        );
        assert!(lines[2].ends_with("03"), "{text}");
    }
}

//! One delegation tree as text (the CLI's `tree`, the MCP `tree` tool): each contract with its delegate, status, depth,
//! trust, deadline and ledger; the refusals beside the parent they were
//! asked of, with every violated code and its requested and allowed
//! values; completion verdicts with the refused criteria and the claim.
//! Reading only: contracts by ListChildren, receipts by Watch.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::Duration;

use prost::Message;

use broker_wire::pb;

use crate::agent::SessionClient;

/// Contracts printed unless the caller's maximum says otherwise.
pub const DEFAULT_TREE_CONTRACTS: u32 = 2_000;
/// Most contracts the caller's maximum may ask for.
pub const MAX_TREE_CONTRACTS: u32 = 100_000;
/// Most Watch events read (receipts and contracts of the subtree).
pub const MAX_TREE_EVENTS: usize = 1_000_000;
/// Most receipts kept per contract (the rest are counted).
pub const MAX_RECEIPTS_SHOWN: usize = 32;
/// Watch does not mark the end of the stored events. Stored events are
/// sent without waiting, in commit order, so once every contract read has
/// arrived as an event and this long passes without another, the receipts
/// behind them are in.
pub const QUIET_MS: u64 = 500;
/// Longest the Watch phase may take; past it the tree is printed with a
/// note that receipts may be missing.
pub const WATCH_PHASE_MS: u64 = 30_000;
/// Longest the contracts phase may take.
pub const TREE_READ_TIMEOUT_MS: u64 = 120_000;
/// Children asked per ListChildren page.
const CHILDREN_PAGE: u32 = 1_000;
/// Most bytes read from `--names`.
const MAX_NAMES_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// What the tree is drawn from.
#[derive(Debug, Default)]
pub struct TreeData {
    /// The contract asked for, first; then every contract read, parents
    /// before children.
    pub contracts: Vec<pb::ContractState>,
    /// Receipts (with their ids) by the contract they are about (a
    /// refusal: the parent asked), in the order signed.
    pub receipts: HashMap<Vec<u8>, Vec<([u8; 32], pb::Receipt)>>,
    /// Children of printed contracts not read because of
    /// the caller's maximum (their own descendants are not counted).
    pub left_out: u64,
    /// Receipts not kept (`MAX_RECEIPTS_SHOWN` per contract).
    pub receipts_left_out: u64,
    /// The Watch phase ran out of time: receipts may be missing.
    pub receipts_incomplete: bool,
}

/// The address book of `--names`.
pub fn read_names(path: &std::path::Path) -> anyhow::Result<BTreeMap<[u8; 32], String>> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_NAMES_FILE_BYTES).read_to_string(&mut text))
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let table: HashMap<String, String> =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    table
        .into_iter()
        .map(|(key, name)| {
            let bytes = hex::decode(key.trim())
                .map_err(|e| anyhow::anyhow!("names.{key}: not hex: {e}"))?;
            let key = broker_wire::crypto::public_key(&bytes)
                .map_err(|e| anyhow::anyhow!("names.{key}: {e}"))?;
            Ok((key.to_bytes(), name))
        })
        .collect()
}

/// Reads the subtree of `id`: its contracts breadth first (at most `max`),
/// then its receipts from Watch (see `QUIET_MS`).
pub async fn fetch(client: &mut SessionClient, id: &[u8], max: u32) -> anyhow::Result<TreeData> {
    let mut data = tokio::time::timeout(
        Duration::from_millis(TREE_READ_TIMEOUT_MS),
        contracts(client, id, max),
    )
    .await
    .map_err(|_| {
        anyhow::anyhow!("reading the contracts took longer than {TREE_READ_TIMEOUT_MS} ms")
    })??;
    receipts(client, id, &mut data).await?;
    Ok(data)
}

/// `fetch` through `link`'s session, opened again once if the broker no
/// longer takes it; a failure that is not the broker's answer is
/// UNAVAILABLE.
pub async fn fetch_linked(
    link: &crate::Link,
    id: &[u8],
    max: u32,
) -> Result<TreeData, crate::BrokerError> {
    link.read(|mut client| async move {
        fetch(&mut client, id, max)
            .await
            .map_err(|e| match e.downcast::<tonic::Status>() {
                Ok(status) => status,
                Err(e) => tonic::Status::unavailable(e.to_string()),
            })
    })
    .await
}

/// The contracts of the subtree, breadth first, at most `max`.
async fn contracts(client: &mut SessionClient, id: &[u8], max: u32) -> anyhow::Result<TreeData> {
    let mut data = TreeData::default();
    let top = client
        .get_contract(pb::GetContractRequest {
            contract_id: id.to_vec(),
        })
        .await?
        .into_inner()
        .contract
        .ok_or_else(|| anyhow::anyhow!("the broker answered without the contract"))?;
    data.contracts.push(top);
    let mut next = 0;
    while next < data.contracts.len() {
        let parent = data.contracts[next].contract_id.clone();
        next += 1;
        let mut page_token = Vec::new();
        loop {
            let page = client
                .list_children(pb::ListChildrenRequest {
                    contract_id: parent.clone(),
                    page_size: CHILDREN_PAGE,
                    page_token,
                })
                .await?
                .into_inner();
            let full = data.contracts.len() >= max as usize;
            for child in page.children {
                if data.contracts.len() < max as usize {
                    data.contracts.push(child);
                } else {
                    data.left_out += 1;
                }
            }
            // Past the cap, one page per parent is enough to say "at least".
            if page.next_page_token.is_empty() || full {
                break;
            }
            page_token = page.next_page_token;
        }
    }
    Ok(data)
}

/// The receipts of the contracts read, from Watch.
async fn receipts(
    client: &mut SessionClient,
    id: &[u8],
    data: &mut TreeData,
) -> anyhow::Result<()> {
    use tokio_stream::StreamExt;
    let known: std::collections::HashSet<Vec<u8>> = data
        .contracts
        .iter()
        .map(|c| c.contract_id.clone())
        .collect();
    let mut unseen = known.clone();
    let mut events = client
        .watch(pb::WatchRequest {
            contract_id: id.to_vec(),
            cursor: 0,
        })
        .await?
        .into_inner();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(WATCH_PHASE_MS);
    for _ in 0..MAX_TREE_EVENTS {
        // Until every contract read has come by, wait up to the deadline;
        // after, only for the quiet period.
        let quiet = tokio::time::Instant::now() + Duration::from_millis(QUIET_MS);
        let wait = if unseen.is_empty() {
            deadline.min(quiet)
        } else {
            deadline
        };
        let event = match tokio::time::timeout_at(wait, events.next()).await {
            Ok(Some(event)) => event?,
            Ok(None) => break,
            Err(_) => {
                data.receipts_incomplete = wait == deadline;
                break;
            }
        };
        match event.event {
            Some(pb::watch_response::Event::Contract(sealed)) => {
                unseen.remove(broker_wire::crypto::sha256(&sealed.payload).as_slice());
            }
            Some(pb::watch_response::Event::Receipt(sealed)) => {
                let receipt = pb::Receipt::decode(sealed.payload.as_slice())?;
                if !known.contains(&receipt.contract_id) {
                    continue;
                }
                let kept = data
                    .receipts
                    .entry(receipt.contract_id.clone())
                    .or_default();
                if kept.len() < MAX_RECEIPTS_SHOWN {
                    kept.push((broker_wire::crypto::sha256(&sealed.payload), receipt));
                } else {
                    data.receipts_left_out += 1;
                }
            }
            None => {}
        }
    }
    Ok(())
}

/// The tree as indented text (pure: what `tree` prints).
pub fn render(data: &TreeData, names: &BTreeMap<[u8; 32], String>) -> String {
    let mut drawing = Drawing {
        data,
        names,
        children: HashMap::new(),
        contracts: HashMap::new(),
        drawn: std::cell::RefCell::new(std::collections::HashSet::new()),
    };
    for state in &data.contracts {
        if let Some(contract) = decode(state) {
            drawing
                .children
                .entry(contract.parent_id.clone())
                .or_default()
                .push(state);
            drawing
                .contracts
                .insert(state.contract_id.as_slice(), contract);
        }
    }
    let mut out = String::new();
    if let Some(top) = data.contracts.first() {
        drawing.node(&mut out, top, "", "");
    }
    if data.left_out > 0 {
        let _ = writeln!(
            out,
            "… at least {} more contracts not shown (--max-contracts)",
            data.left_out
        );
    }
    if data.receipts_left_out > 0 {
        let _ = writeln!(
            out,
            "… {} more receipts not shown (at most {MAX_RECEIPTS_SHOWN} per contract)",
            data.receipts_left_out
        );
    }
    if data.receipts_incomplete {
        let _ = writeln!(
            out,
            "… the broker's events stopped before the tree's were all in: receipts may be missing"
        );
    }
    out
}

fn decode(state: &pb::ContractState) -> Option<pb::Contract> {
    crate::terms(state.contract.as_ref())
}

/// `name` from the address book, else the key's first 8 hex characters.
fn who(key: &[u8], names: &BTreeMap<[u8; 32], String>) -> String {
    <[u8; 32]>::try_from(key)
        .ok()
        .and_then(|k| names.get(&k).map(|n| safe(n)))
        .unwrap_or_else(|| format!("key:{}", short(key)))
}

/// A contract's delegate: its address-book name, else the workload
/// identity stamped at issuance, else its short key.
fn holder(contract: &pb::Contract, names: &BTreeMap<[u8; 32], String>) -> String {
    let named = <[u8; 32]>::try_from(contract.delegate_public_key.as_slice())
        .is_ok_and(|k| names.contains_key(&k));
    if !named && !contract.delegate_identity.is_empty() {
        return safe(&contract.delegate_identity);
    }
    who(&contract.delegate_public_key, names)
}

pub fn short(bytes: &[u8]) -> String {
    hex::encode(&bytes[..bytes.len().min(4)])
}

/// What drawing a tree reads: the data, indexed.
struct Drawing<'a> {
    data: &'a TreeData,
    names: &'a BTreeMap<[u8; 32], String>,
    /// Contracts by their parent's id.
    children: HashMap<Vec<u8>, Vec<&'a pb::ContractState>>,
    /// Decoded contracts by id.
    contracts: HashMap<&'a [u8], pb::Contract>,
    /// Contracts drawn so far: bad data with a cycle is drawn once.
    drawn: std::cell::RefCell<std::collections::HashSet<Vec<u8>>>,
}

impl Drawing<'_> {
    /// One contract's lines, then its children's: `lead` starts its first
    /// line, `rest` every line below it.
    fn node(&self, out: &mut String, state: &pb::ContractState, lead: &str, rest: &str) {
        let (data, names) = (self.data, self.names);
        if !self.drawn.borrow_mut().insert(state.contract_id.clone()) {
            let _ = writeln!(out, "{lead}{} (drawn above)", short(&state.contract_id));
            return;
        }
        let Some(contract) = self.contracts.get(state.contract_id.as_slice()) else {
            let _ = writeln!(
                out,
                "{lead}{} (undecodable contract)",
                short(&state.contract_id)
            );
            return;
        };
        let status = crate::names::status_name(state.status);
        let _ = writeln!(
            out,
            "{lead}{} {} {status} depth {} trust {} deadline {}",
            short(&state.contract_id),
            holder(contract, names),
            contract.depth,
            ppm(contract.cumulative_trust_ppm),
            rfc3339(contract.deadline_ms),
        );
        let pad = format!("{rest}  ");
        if let Some(ledger) = &state.ledger {
            let _ = writeln!(
                out,
                "{pad}ledger {} {} spent, {} reserved, {} free of {}",
                bar(ledger),
                ledger.spent,
                ledger.reserved,
                ledger.residual,
                ledger.budget
            );
        }
        for receipt in data
            .receipts
            .get(&state.contract_id)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            receipt_lines(out, &pad, &receipt.1);
        }
        let kids = self
            .children
            .get(state.contract_id.as_slice())
            .map(Vec::as_slice)
            .unwrap_or_default();
        for (i, kid) in kids.iter().enumerate() {
            let last = i + 1 == kids.len();
            let (branch, more) = if last {
                ("└─ ", "   ")
            } else {
                ("├─ ", "│  ")
            };
            self.node(
                out,
                kid,
                &format!("{rest}{branch}"),
                &format!("{rest}{more}"),
            );
        }
    }
}

/// The lines a receipt adds under its contract: refusals and verdicts
/// (acceptances and cascades show in the status already).
fn receipt_lines(out: &mut String, pad: &str, receipt: &pb::Receipt) {
    let kind = pb::ReceiptKind::try_from(receipt.kind).unwrap_or(pb::ReceiptKind::Unspecified);
    match kind {
        pb::ReceiptKind::Refused => {
            let codes: Vec<String> = receipt
                .violations
                .iter()
                .map(|v| {
                    let code = crate::names::code_name(v.code);
                    format!(
                        "{code} (requested {}, allowed {})",
                        safe(&v.requested),
                        safe(&v.allowed)
                    )
                })
                .collect();
            let _ = writeln!(out, "{pad}✗ refused a child: {}", codes.join("; "));
        }
        _ => {
            if let Some(completion) = &receipt.completion {
                let verdict = pb::Verdict::try_from(completion.verdict)
                    .map(|v| v.as_str_name().trim_start_matches("VERDICT_").to_owned())
                    .unwrap_or_else(|_| format!("verdict {}", completion.verdict));
                let refused: Vec<String> = completion
                    .refused_criteria
                    .iter()
                    .map(|c| safe(&c.criterion))
                    .collect();
                let _ = write!(
                    out,
                    "{pad}verdict {verdict}, consumed {}, returned {}",
                    completion.consumed, completion.returned
                );
                // A claim beyond what was charged: nobody observed it, and
                // the principal should see it.
                if completion.claimed_excess > 0 {
                    let _ = write!(out, ", claimed excess {}", completion.claimed_excess);
                }
                if !refused.is_empty() {
                    let _ = write!(out, ", refused: {}", refused.join(", "));
                }
                if !completion.out_of_scope_paths.is_empty() {
                    let _ = write!(
                        out,
                        ", out of scope: {}",
                        completion
                            .out_of_scope_paths
                            .iter()
                            .map(|p| safe(p))
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
                let _ = writeln!(out);
                if !completion.claim.is_empty() {
                    let _ = writeln!(out, "{pad}  claim: {}", one_line(&completion.claim));
                }
            }
        }
    }
}

/// A claim on one line, at most 120 characters, made safe.
fn one_line(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c == '\n' || c == '\t' { ' ' } else { c })
        .collect();
    if flat.chars().count() > 120 {
        format!("{}…", safe(&flat.chars().take(119).collect::<String>()))
    } else {
        safe(&flat)
    }
}

/// Text an agent wrote, safe for a terminal: control characters (ANSI and
/// OSC escapes start with one) and bidirectional overrides, which could
/// forge or reorder what the operator reads, are shown as `\u{…}`.
pub fn safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let bidi = matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || bidi {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    out
}

/// 10 cells: spent `#`, reserved `+`, free `.` (an overspend is all `#`).
fn bar(ledger: &pb::Ledger) -> String {
    const CELLS: i64 = 10;
    if ledger.budget <= 0 {
        return format!("[{}]", ".".repeat(CELLS as usize));
    }
    let cells = |n: i64| (n.clamp(0, ledger.budget) * CELLS / ledger.budget) as usize;
    let spent = cells(ledger.spent);
    let reserved = cells(ledger.spent.saturating_add(ledger.reserved)).saturating_sub(spent);
    let free = (CELLS as usize).saturating_sub(spent + reserved);
    format!(
        "[{}{}{}]",
        "#".repeat(spent),
        "+".repeat(reserved),
        ".".repeat(free)
    )
}

/// Parts per million as a decimal fraction, e.g. 900000 → "0.900".
pub fn ppm(ppm: u32) -> String {
    format!("{}.{:03}", ppm / 1_000_000, (ppm % 1_000_000) / 1_000)
}

/// Unix milliseconds as UTC RFC 3339, to the second.
pub fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1_000);
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_ledgers_and_trust_print_exactly() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_155_162_394), "2026-12-01T19:59:22Z");
        assert_eq!(ppm(1_000_000), "1.000");
        assert_eq!(ppm(810_000), "0.810");
        let ledger = |budget, spent, reserved| pb::Ledger {
            budget,
            spent,
            reserved,
            residual: budget - spent - reserved,
            open_children: 0,
        };
        assert_eq!(bar(&ledger(100, 0, 0)), "[..........]");
        assert_eq!(bar(&ledger(100, 30, 20)), "[###++.....]");
        assert_eq!(bar(&ledger(100, 150, 0)), "[##########]");
        assert_eq!(bar(&ledger(0, 0, 0)), "[..........]");
        assert_eq!(one_line("a\nb"), "a b");
        assert_eq!(safe("ok \u{1b}[2J\u{202e}x"), "ok \\u{1b}[2J\\u{202e}x");
        assert_eq!(safe("src/é.rs"), "src/é.rs");
    }
}

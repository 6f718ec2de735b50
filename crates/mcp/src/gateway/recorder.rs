//! Group commit of host observations: the observations of calls answered
//! at about the same time go to the broker in one signed RecordReceipts per
//! contract, and each call learns whether its own were recorded before it
//! answers (record before answering: a call the model saw answered is in
//! the broker, so a crash of the gateway loses none). What goes in one
//! request is `plan`, pure and tested; the loop only sends.

use tokio::sync::{mpsc, oneshot};

use broker_client::{BrokerError, Link};
use broker_domain::limits::MAX_OBSERVATIONS_PER_REQUEST;
use broker_wire::pb;

/// Most calls waiting to be recorded; past it a call waits for room (the
/// calls in flight are bounded by the MCP client's concurrency anyway).
const MAX_QUEUED_CALLS: usize = 4096;
/// Most calls taken into one round of requests.
const MAX_CALLS_PER_ROUND: usize = 1024;

/// One answered call's observations, waiting to be recorded.
pub struct Entry {
    pub contract: [u8; 32],
    pub observations: Vec<pb::Observation>,
    /// The call's trace context; a request carries its first entry's.
    pub trace: Option<String>,
    pub done: oneshot::Sender<Result<(), BrokerError>>,
}

/// The requests a round makes: entries (by index) grouped per contract in
/// arrival order, each group at most `MAX_OBSERVATIONS_PER_REQUEST`
/// observations; an entry is never split (none has more than that).
pub fn plan(entries: &[([u8; 32], usize)]) -> Vec<Vec<usize>> {
    let mut requests: Vec<(usize, [u8; 32], usize, Vec<usize>)> = Vec::new();
    for (i, (contract, count)) in entries.iter().enumerate() {
        // The open request of this contract with room, else a new one.
        match requests
            .iter_mut()
            .rev()
            .find(|(_, c, used, _)| c == contract && used + count <= MAX_OBSERVATIONS_PER_REQUEST)
        {
            Some((_, _, used, members)) => {
                *used += count;
                members.push(i);
            }
            None => requests.push((requests.len(), *contract, *count, vec![i])),
        }
    }
    requests
        .into_iter()
        .map(|(_, _, _, members)| members)
        .collect()
}

/// The handle calls record through.
#[derive(Clone)]
pub struct Recorder {
    queue: mpsc::Sender<Entry>,
}

impl Recorder {
    /// Starts the recording loop, signing as the link's agent (the host).
    pub fn start(link: Link) -> Self {
        let (queue, entries) = mpsc::channel(MAX_QUEUED_CALLS);
        tokio::spawn(run(link, entries));
        Self { queue }
    }

    /// Records one call's observations; returns once the broker has.
    pub async fn record(
        &self,
        contract: [u8; 32],
        observations: Vec<pb::Observation>,
        trace: Option<String>,
    ) -> Result<(), BrokerError> {
        let (done, recorded) = oneshot::channel();
        let entry = Entry {
            contract,
            observations,
            trace,
            done,
        };
        let stopped = || BrokerError::new("NOT_RECORDED", "the gateway's recorder has stopped");
        self.queue.send(entry).await.map_err(|_| stopped())?;
        recorded.await.map_err(|_| stopped())?
    }
}

async fn run(link: Link, mut queue: mpsc::Receiver<Entry>) {
    while let Some(first) = queue.recv().await {
        let mut round = vec![first];
        while round.len() < MAX_CALLS_PER_ROUND {
            match queue.try_recv() {
                Ok(entry) => round.push(entry),
                Err(_) => break,
            }
        }
        let shape: Vec<_> = round
            .iter()
            .map(|e| (e.contract, e.observations.len()))
            .collect();
        let mut slots: Vec<Option<Entry>> = round.into_iter().map(Some).collect();
        // The round's requests go together; each answers its own calls.
        let mut sends = tokio::task::JoinSet::new();
        for members in plan(&shape) {
            let entries: Vec<Entry> = members
                .into_iter()
                .filter_map(|i| slots[i].take())
                .collect();
            sends.spawn(send(link.clone(), entries));
        }
        while sends.join_next().await.is_some() {}
    }
}

/// One RecordReceipts for entries of one contract; tells each the outcome.
async fn send(link: Link, entries: Vec<Entry>) {
    let Some(contract) = entries.first().map(|e| e.contract) else {
        return;
    };
    let body = pb::RecordReceiptsBody {
        header: None,
        contract_id: contract.to_vec(),
        observations: entries
            .iter()
            .flat_map(|e| e.observations.iter().cloned())
            .collect(),
    };
    let trace = entries.iter().find_map(|e| e.trace.as_deref());
    let outcome = link
        .call(body, trace)
        .await
        .map(|_| ())
        .inspect_err(|error| {
            tracing::warn!(reason = %error.reason, message = %error.message, "the broker did not record tool calls");
        });
    for entry in entries {
        let result = outcome.as_ref().map(|_| ()).map_err(|error| {
            BrokerError::new(
                "NOT_RECORDED",
                format!(
                    "the call ran, but the broker did not record it ({}: {}); its result is withheld",
                    error.reason, error.message
                ),
            )
            .with("broker_reason", error.reason.as_str())
        });
        // A caller that gave up (its client went away) needs no answer.
        let _ = entry.done.send(result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_share_a_request_per_contract_up_to_the_limit() {
        let (a, b) = ([1; 32], [2; 32]);
        assert_eq!(plan(&[]), Vec::<Vec<usize>>::new());
        assert_eq!(plan(&[(a, 3), (b, 1), (a, 2)]), [vec![0, 2], vec![1]]);
        // 200 + 100 do not fit one request; the third call joins one that
        // has room for it, and none is split.
        assert_eq!(plan(&[(a, 200), (a, 100), (a, 56)]), [vec![0], vec![1, 2]]);
        assert_eq!(
            plan(&[(a, MAX_OBSERVATIONS_PER_REQUEST), (a, 1)]),
            [vec![0], vec![1]]
        );
        // Every entry is planned exactly once.
        let many: Vec<_> = (0..1000)
            .map(|i| ([(i % 3) as u8; 32], 1 + i % 7))
            .collect();
        let mut seen: Vec<usize> = plan(&many).into_iter().flatten().collect();
        seen.sort();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
        for request in plan(&many) {
            let total: usize = request.iter().map(|&i| many[i].1).sum();
            assert!(total <= MAX_OBSERVATIONS_PER_REQUEST);
            assert!(request.iter().all(|&i| many[i].0 == many[request[0]].0));
        }
    }
}

//! Reads: GetContract, GetChain, ListChildren, ListRoots and GetReceipt, each for a
//! configured reader or a party of the tree, each answer within the
//! response limit.

use prost::Message;
use tonic::Request;

use super::BrokerService;
use super::convert;
use super::error::ServiceError;
use crate::core::InputError;
use crate::core::limits::CHILDREN_PAGE_BYTES;
use crate::core::limits::{DEFAULT_PAGE_SIZE, MAX_DEPTH_CEILING, MAX_PAGE_SIZE, MAX_ROOTS_SCANNED};
use crate::pb;
use crate::store::Store;

/// Page tokens are the last returned issuance sequence number, big-endian.
fn page_cursor(token: &[u8]) -> Result<i64, InputError> {
    if token.is_empty() {
        return Ok(0);
    }
    let bytes: [u8; 8] = token
        .try_into()
        .map_err(|_| InputError::new("page_token", "is not a token this broker issued"))?;
    Ok(i64::from_be_bytes(bytes))
}

/// A request's page size: 0 means the default, above the maximum is an
/// error.
fn page_size(requested: u32) -> Result<u32, InputError> {
    match requested {
        0 => Ok(DEFAULT_PAGE_SIZE),
        n if n > MAX_PAGE_SIZE => Err(InputError::new(
            "page_size",
            format!("{n} is above {MAX_PAGE_SIZE}"),
        )),
        n => Ok(n),
    }
}

/// A page's start from its token, refusing tokens the broker never issued.
fn page_start(token: &[u8]) -> Result<i64, InputError> {
    match page_cursor(token)? {
        seq if seq < 0 => Err(InputError::new(
            "page_token",
            "is not a token this broker issued",
        )),
        seq => Ok(seq),
    }
}

/// One page request's bounds, and the response's.
struct Paging {
    bounds: crate::store::PageBounds,
    response_limit: usize,
}

impl Paging {
    /// A page of contracts as a response (`build` from the states and the
    /// next page's token), refused when larger than a response.
    fn respond<R: Message>(
        &self,
        page: crate::store::ContractsPage,
        hint: &'static str,
        build: impl FnOnce(Vec<pb::ContractState>, Vec<u8>) -> R,
    ) -> Result<R, ServiceError> {
        let states = page.contracts.into_iter().map(convert::contract_state);
        let states = states.collect();
        let next_page_token = page
            .next_before
            .map(|seq| seq.to_be_bytes().to_vec())
            .unwrap_or_default();
        fitting(build(states, next_page_token), self.response_limit, hint)
    }
}

/// A page, refused when larger than a response: only a single contract
/// larger than a whole response gets there (pages are cut at half of one).
fn fitting<R: Message>(response: R, limit: usize, hint: &'static str) -> Result<R, ServiceError> {
    let size = response.encoded_len();
    if size > limit {
        return Err(ServiceError::ResponseTooLarge { size, limit, hint });
    }
    Ok(response)
}

impl<S: Store> BrokerService<S> {
    /// A page request's bounds under this broker's response limit.
    fn paging(&self, requested_size: u32, token: &[u8]) -> Result<Paging, InputError> {
        let response_limit = self.config.limits.max_response_bytes();
        Ok(Paging {
            bounds: crate::store::PageBounds {
                limit: page_size(requested_size)?,
                before_seq: page_start(token)?,
                // Half the response limit leaves room for the states
                // around the envelopes.
                max_bytes: CHILDREN_PAGE_BYTES.min(response_limit / 2),
            },
            response_limit,
        })
    }

    /// The chain of `record`, root first.
    pub(super) async fn chain(
        &self,
        mut record: crate::store::ContractRecord,
    ) -> Result<Vec<pb::ContractState>, ServiceError> {
        let mut chain = Vec::new();
        loop {
            let parent = record.parent_id;
            chain.push(convert::contract_state(record));
            let Some(parent) = parent else { break };
            // Depth is bounded by policy; a longer walk means a cycle.
            if chain.len() > MAX_DEPTH_CEILING as usize + 1 {
                return Err(ServiceError::Internal(
                    "contract chain longer than the depth ceiling".into(),
                ));
            }
            record = self.store.contract(parent).await?.ok_or_else(|| {
                ServiceError::Internal(format!(
                    "parent {} of a stored contract is missing",
                    hex::encode(parent)
                ))
            })?;
        }
        chain.reverse();
        Ok(chain)
    }

    pub(super) async fn children(
        &self,
        request: pb::ListChildrenRequest,
    ) -> Result<pb::ListChildrenResponse, ServiceError> {
        let id = convert::id(&request.contract_id, "contract_id")?;
        let page_size = page_size(request.page_size)?;
        let after = page_cursor(&request.page_token)?;
        if self.store.contract(id).await?.is_none() {
            return Err(ServiceError::not_found(crate::store::Entity::Contract, id));
        }
        // Half the response limit leaves room for the states around the
        // envelopes.
        let limit = self.config.limits.max_response_bytes();
        let page_bytes = CHILDREN_PAGE_BYTES.min(limit / 2);
        let children = self
            .store
            .children(id, after, page_size, page_bytes)
            .await?;
        let bytes: usize = children.iter().map(|c| c.envelope.encoded_len()).sum();
        // A page cut by count or by bytes has a next page (perhaps empty).
        let next_page_token = match children.last() {
            Some(last) if children.len() == page_size as usize || bytes >= page_bytes => {
                last.seq.to_be_bytes().to_vec()
            }
            _ => Vec::new(),
        };
        let response = pb::ListChildrenResponse {
            children: children.into_iter().map(convert::contract_state).collect(),
            next_page_token,
        };
        fitting(
            response,
            limit,
            "this child alone is larger than a response; read it with GetContract under a larger limits.max_request_bytes",
        )
    }

    pub(super) async fn receipt(
        &self,
        request: pb::GetReceiptRequest,
    ) -> Result<pb::GetReceiptResponse, ServiceError> {
        let id = convert::id(&request.receipt_id, "receipt_id")?;
        let receipt = self
            .store
            .receipt(id)
            .await?
            .ok_or_else(|| ServiceError::not_found(crate::store::Entity::Receipt, id))?;
        Ok(pb::GetReceiptResponse {
            receipt: Some(receipt),
        })
    }

    pub(super) async fn get_contract(
        &self,
        request: Request<pb::GetContractRequest>,
    ) -> Result<pb::GetContractResponse, ServiceError> {
        let (record, _turn) = self
            .authorize_record(&request, &request.get_ref().contract_id, "contract_id")
            .await?;
        Ok(pb::GetContractResponse {
            contract: Some(convert::contract_state(record)),
        })
    }

    pub(super) async fn get_chain(
        &self,
        request: Request<pb::GetChainRequest>,
    ) -> Result<pb::GetChainResponse, ServiceError> {
        let (record, _turn) = self
            .authorize_record(&request, &request.get_ref().contract_id, "contract_id")
            .await?;
        let chain = self.chain(record).await?;
        let response = pb::GetChainResponse { chain };
        fitting(
            response,
            self.config.limits.max_response_bytes(),
            "read the chain's contracts one by one with GetContract",
        )
    }

    pub(super) async fn list_children(
        &self,
        request: Request<pb::ListChildrenRequest>,
    ) -> Result<pb::ListChildrenResponse, ServiceError> {
        let (_, _turn) = self
            .authorize_read(&request, &request.get_ref().contract_id, "contract_id")
            .await?;
        self.children(request.into_inner()).await
    }

    pub(super) async fn list_roots(
        &self,
        request: Request<pb::ListRootsRequest>,
    ) -> Result<pb::ListRootsResponse, ServiceError> {
        let caller = self.caller(&request)?;
        let _turn = self.admit_caller(&caller).await?;
        let request = request.into_inner();
        let labels = crate::core::labels(&request.labels, "labels")?;
        let paging = self.paging(request.page_size, &request.page_token)?;
        let viewer = (!self.reads_everything(&caller).await?).then_some(caller);
        let page = self
            .store
            .roots(&crate::store::RootsQuery {
                viewer,
                labels,
                scan: MAX_ROOTS_SCANNED,
                page: paging.bounds,
            })
            .await?;
        let hint = "this root alone is larger than a response; read it with GetContract under a larger limits.max_request_bytes";
        paging.respond(page, hint, |roots, next| pb::ListRootsResponse {
            roots,
            next_page_token: next,
        })
    }

    pub(super) async fn list_held(
        &self,
        request: Request<pb::ListHeldRequest>,
    ) -> Result<pb::ListHeldResponse, ServiceError> {
        let caller = self.caller(&request)?;
        let _turn = self.admit_caller(&caller).await?;
        let request = request.into_inner();
        let role = match pb::HeldRole::try_from(request.role) {
            Ok(pb::HeldRole::Delegate) => crate::store::HeldRole::Delegate,
            Ok(pb::HeldRole::Host) => crate::store::HeldRole::Host,
            Ok(pb::HeldRole::Unspecified) | Err(_) => {
                return Err(InputError::new(
                    "role",
                    "must be HELD_ROLE_DELEGATE or HELD_ROLE_HOST",
                )
                .into());
            }
        };
        let paging = self.paging(request.page_size, &request.page_token)?;
        let page = self
            .store
            .held(&crate::store::HeldQuery {
                key: caller,
                role,
                page: paging.bounds,
            })
            .await?;
        let hint = "this contract alone is larger than a response; read it with GetContract under a larger limits.max_request_bytes";
        paging.respond(page, hint, |contracts, next| pb::ListHeldResponse {
            contracts,
            next_page_token: next,
        })
    }

    pub(super) async fn get_receipt(
        &self,
        request: Request<pb::GetReceiptRequest>,
    ) -> Result<pb::GetReceiptResponse, ServiceError> {
        let caller = self.caller(&request)?;
        let _turn = self.admit_caller(&caller).await?;
        let request_id = request.get_ref().receipt_id.clone();
        let response = self.receipt(request.into_inner()).await?;
        // A receipt is read as part of the tree of the contract it is about
        // (for a refusal, the parent asked).
        let about = response
            .receipt
            .as_ref()
            .and_then(|e| pb::Receipt::decode(e.payload.as_slice()).ok())
            .and_then(|r| crate::core::Id::try_from(r.contract_id.as_slice()).ok())
            .ok_or_else(|| ServiceError::Internal("a stored receipt names no contract".into()))?;
        // A stranger is told what an unknown receipt gets.
        match self.authorize(&caller, about).await {
            Ok(()) => Ok(response),
            Err(ServiceError::NotFound { .. }) => Err(ServiceError::not_found(
                crate::store::Entity::Receipt,
                &request_id,
            )),
            Err(e) => Err(e),
        }
    }
}

//! The MCP server of the tools: a call's arguments checked against the
//! tool's published schema before it runs, the `contract://` resources
//! and their subscriptions, and what the server tells a client of itself.

use rmcp::model::{CallToolResult, ServerCapabilities, ServerConfig};
use rmcp::{ServerHandler, tool_handler};
use serde_json::Value;

use super::Tools;
use crate::resources;

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Tools {
    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, rmcp::ErrorData> {
        let arguments = request.arguments.clone().unwrap_or_default();
        if let Err(error) = self.arguments.check(&request.name, &arguments) {
            return Ok(crate::tool_result(error).into());
        }
        let call = rmcp::handler::server::tool::ToolCallContext::new(self, request, context);
        self.tool_router.call(call).await
    }

    async fn list_resource_templates(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ListResourceTemplatesResult, rmcp::ErrorData> {
        Ok(rmcp::model::ListResourceTemplatesResult::with_all_items(
            resources::templates(),
        ))
    }

    async fn read_resource(
        &self,
        request: rmcp::model::ReadResourceRequestParams,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ReadResourceResponse, rmcp::ErrorData> {
        let contract_id = resources::parse(&request.uri)?;
        let value = self
            .contract_json(&contract_id)
            .await
            .map_err(|e| resource_error(crate::tool_result(e)))?;
        Ok(rmcp::model::ReadResourceResult::new(vec![
            rmcp::model::ResourceContents::text(value.to_string(), request.uri)
                .with_mime_type("application/json"),
        ])
        .into())
    }

    #[allow(deprecated)]
    async fn subscribe(
        &self,
        request: rmcp::model::SubscribeRequestParams,
        context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<(), rmcp::ErrorData> {
        let contract_id = resources::parse(&request.uri)?;
        let mut subscriptions = self.subscriptions.lock().unwrap_or_else(|p| p.into_inner());
        subscriptions.retain(|_, task| !task.is_finished());
        if subscriptions.contains_key(&request.uri) {
            return Ok(());
        }
        if subscriptions.len() >= resources::MAX_SUBSCRIPTIONS {
            return Err(rmcp::ErrorData::invalid_request(
                format!(
                    "at most {} contracts are followed at once: unsubscribe one first",
                    resources::MAX_SUBSCRIPTIONS
                ),
                None,
            ));
        }
        let uri = request.uri.clone();
        let peer = context.peer;
        let task = tokio::spawn(resources::follow(
            self.link.clone(),
            contract_id,
            move || {
                let (peer, uri) = (peer.clone(), uri.clone());
                async move {
                    peer.notify_resource_updated(
                        rmcp::model::ResourceUpdatedNotificationParam::new(uri),
                    )
                    .await
                    .is_ok()
                }
            },
        ));
        subscriptions.insert(request.uri, task.abort_handle());
        Ok(())
    }

    #[allow(deprecated)]
    async fn unsubscribe(
        &self,
        request: rmcp::model::UnsubscribeRequestParams,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<(), rmcp::ErrorData> {
        let mut subscriptions = self.subscriptions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(task) = subscriptions.remove(&request.uri) {
            task.abort();
        }
        Ok(())
    }

    fn accepted_subscription_filter(
        &self,
        requested: &rmcp::model::SubscriptionFilter,
    ) -> Option<rmcp::model::SubscriptionFilter> {
        let mut accepted = rmcp::model::SubscriptionFilter::default();
        accepted.resource_subscriptions = requested.resource_subscriptions.as_ref().map(|uris| {
            uris.iter()
                .filter(|uri| resources::parse(uri).is_ok())
                .take(resources::MAX_SUBSCRIPTIONS)
                .cloned()
                .collect()
        });
        Some(accepted)
    }

    async fn listen(
        &self,
        context: rmcp::service::SubscriptionContext,
    ) -> Result<(), rmcp::ErrorData> {
        let uris = context
            .accepted()
            .resource_subscriptions
            .clone()
            .unwrap_or_default();
        let mut follows = tokio::task::JoinSet::new();
        for uri in uris {
            let Ok(contract_id) = resources::parse(&uri) else {
                continue;
            };
            let sink = context.sink().clone();
            follows.spawn(resources::follow(
                self.link.clone(),
                contract_id,
                move || {
                    let (sink, uri) = (sink.clone(), uri.clone());
                    async move { sink.notify_resource_updated(uri).await.is_ok() }
                },
            ));
        }
        context.cancelled().await;
        follows.abort_all();
        Ok(())
    }

    fn get_info(&self) -> ServerConfig {
        let mut config = ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .enable_resources_subscribe()
                .build(),
        )
            .with_instructions(
                "Delegation through the broker: open_root or hold a contract, delegate parts of it, accept/complete what is delegated to you. Refusals list each violated invariant with requested and allowed values.",
            );
        config.server_info =
            rmcp::model::Implementation::new("delegation-broker", env!("CARGO_PKG_VERSION"));
        config
    }
}

/// A contract resource that cannot be read, as the JSON-RPC error of
/// `resources/read`: the reason and message of the tool error
/// `crate::tool_result` (the one mapping of a broker error) makes of it.
fn resource_error(result: CallToolResult) -> rmcp::ErrorData {
    let error = result
        .structured_content
        .as_ref()
        .and_then(|v| v.get("error"));
    let part = |key: &str| {
        error
            .and_then(|e| e.get(key))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    rmcp::ErrorData::resource_not_found(format!("{}: {}", part("reason"), part("message")), None)
}

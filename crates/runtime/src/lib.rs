//! What every server of the workspace shares — the broker, its console,
//! the A2A and MCP gateways: logs and traces (`telemetry`), listeners that
//! bound connections and drop silent sockets (`listen`), and stopping on
//! SIGINT or SIGTERM (`shutdown`), telling systemd when it is ready and
//! when it stops (`notify`). It knows the public API's names
//! (`broker-wire`) and nothing of the broker's service or store.

pub mod listen;
pub mod notify;
pub mod shutdown;
pub mod telemetry;

/// Declares a tower layer carrying `$state` and the service it wraps
/// around an inner service, holding a clone of the state in `$field`
/// (each middleware writes its own `tower::Service` impl beside it).
#[macro_export]
macro_rules! state_layer {
    (
        $(#[$meta:meta])*
        $vis:vis struct $layer:ident($state:ty) => $service:ident { $field:ident }
    ) => {
        $(#[$meta])*
        #[derive(Clone)]
        $vis struct $layer(pub $state);

        impl<S> tower::Layer<S> for $layer {
            type Service = $service<S>;

            fn layer(&self, inner: S) -> Self::Service {
                $service {
                    inner,
                    $field: self.0.clone(),
                }
            }
        }

        #[doc = concat!("See `", stringify!($layer), "`.")]
        #[derive(Clone)]
        $vis struct $service<S> {
            inner: S,
            $field: $state,
        }
    };
}

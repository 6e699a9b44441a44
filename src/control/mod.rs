//! The control task: the only writer of routing snapshots.
//!
//! The admin API writes the store, then asks the control task (through [`ControlHandle`]) to
//! apply; the task reloads the desired state, builds a new snapshot and publishes it. Requests
//! that arrive while a rebuild runs are coalesced into the next one.

mod build;

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::balance::TargetLoad;
use crate::model::Id;
use crate::snapshot::SnapshotHandle;
use crate::store::{Store, StoreError};

pub use build::build_snapshot;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("the control task has stopped")]
    Stopped,
    #[error("cannot load the routing configuration: {0}")]
    Store(#[from] StoreError),
}

type ApplyReply = oneshot::Sender<Result<u64, Arc<ControlError>>>;

/// Asks the control task to apply the stored configuration.
#[derive(Clone)]
pub struct ControlHandle {
    requests: mpsc::Sender<ApplyReply>,
}

impl ControlHandle {
    /// Returns once a snapshot built after this call has been published; its generation.
    pub async fn apply(&self) -> Result<u64, Arc<ControlError>> {
        let (reply, done) = oneshot::channel();
        self.requests
            .send(reply)
            .await
            .map_err(|_| Arc::new(ControlError::Stopped))?;
        done.await.map_err(|_| Arc::new(ControlError::Stopped))?
    }
}

struct ControlTask {
    store: Store,
    snapshots: SnapshotHandle,
    /// Per-target runtime state carried from snapshot to snapshot by target id.
    loads: HashMap<Id, Arc<TargetLoad>>,
    generation: u64,
}

impl ControlTask {
    async fn rebuild(&mut self) -> Result<u64, ControlError> {
        let config = self.store.load_routing_config().await?;
        self.generation += 1;
        let snapshot = build_snapshot(&config, &mut self.loads, self.generation);
        self.snapshots.publish(snapshot);
        tracing::debug!(generation = self.generation, "published routing snapshot");
        Ok(self.generation)
    }

    async fn run(mut self, mut requests: mpsc::Receiver<ApplyReply>) {
        while let Some(first) = requests.recv().await {
            let mut waiting = vec![first];
            while let Ok(more) = requests.try_recv() {
                waiting.push(more);
            }
            let outcome = self.rebuild().await.map_err(Arc::new);
            if let Err(error) = &outcome {
                tracing::error!(%error, "routing snapshot not rebuilt; the previous one stays live");
            }
            for reply in waiting {
                let _ = reply.send(outcome.clone());
            }
        }
    }
}

/// Publishes the first snapshot from the store, then starts the control task.
pub async fn start(
    store: Store,
    snapshots: SnapshotHandle,
) -> Result<(ControlHandle, JoinHandle<()>), ControlError> {
    let mut task = ControlTask {
        store,
        snapshots,
        loads: HashMap::new(),
        generation: 0,
    };
    task.rebuild().await?;
    let (sender, receiver) = mpsc::channel(256);
    let join = tokio::spawn(task.run(receiver));
    Ok((ControlHandle { requests: sender }, join))
}

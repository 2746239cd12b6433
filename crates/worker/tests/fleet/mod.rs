//! Workers and schedulers in the test's own process, on one store.

#![allow(dead_code)]

use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{Store, StoreError};
use rein_worker::{Registry, Worker, WorkerConfig};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub struct Fleet {
    stops: Vec<(CancellationToken, JoinHandle<Result<(), StoreError>>)>,
}

impl Fleet {
    pub fn new() -> Fleet {
        Fleet { stops: Vec::new() }
    }

    /// A worker with short leases and polls, claiming one run at a time.
    pub fn worker_with(
        mut self,
        store: &Store,
        id: &str,
        concurrency: usize,
        registry: Registry,
    ) -> Fleet {
        let mut config = WorkerConfig::new(id);
        config.lease_ttl_ms = 1_000;
        config.poll_interval_ms = 20;
        config.shutdown_grace_ms = 200;
        config.concurrency = concurrency;
        config.claim_batch = 1;
        let worker = Worker::new(store.clone(), config, registry);
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move { worker.run(stop).await }
        });
        self.stops.push((stop, task));
        self
    }

    pub fn scheduler(mut self, store: &Store, id: &str) -> Fleet {
        let mut config = SchedulerConfig::new(id);
        config.tick_ms = 50;
        let mut scheduler = Scheduler::new(store.clone(), config);
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move { scheduler.run(stop).await }
        });
        self.stops.push((stop, task));
        self
    }

    pub async fn stop(self) {
        for (stop, _) in &self.stops {
            stop.cancel();
        }
        for (_, task) in self.stops {
            task.await.expect("fleet task").expect("fleet member");
        }
    }
}

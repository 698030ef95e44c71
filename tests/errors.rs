//! `?` inside a step: any `std::error::Error` becomes the procedure's failure with its
//! message, type and chain of sources, and the caller receives exactly that, also from
//! the next engine after a restart.

mod common;

use proctor::{async_trait, Context, Executor, Flow, ProcError, Procedure, Registry};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
#[error("region r-17 unavailable")]
struct RegionError {
    #[source]
    cause: std::io::Error,
}

fn reach_region() -> Result<(), RegionError> {
    Err(RegionError {
        cause: std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused"),
    })
}

#[derive(Serialize, Deserialize)]
struct MoveRegion;

#[async_trait]
impl Procedure for MoveRegion {
    async fn execute(&mut self, _ctx: &mut Context) -> Result<Flow, ProcError> {
        reach_region()?;
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

async fn start(store: Box<dyn proctor::ProcedureStore>) -> Executor {
    let mut registry = Registry::new();
    registry.register::<MoveRegion>("move-region");
    Executor::builder()
        .registry(registry)
        .store(store)
        .start()
        .await
        .expect("starts")
}

#[actix::test]
async fn a_step_error_returned_with_question_mark_keeps_its_type_and_sources() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let executor = start(store.open()).await;
        let id = executor.submit(MoveRegion).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        let expected = ProcError::Error {
            message: "region r-17 unavailable".into(),
            type_name: "errors::RegionError".into(),
            sources: vec!["connection refused".into()],
        };
        assert_eq!(failure.error, expected, "{name}");
        assert_eq!(
            failure.to_string(),
            format!(
                "procedure {id} (move-region) failed: region r-17 unavailable: connection refused"
            ),
            "{name}"
        );
        executor.shutdown().await.unwrap();

        let executor = start(store.open()).await;
        let again = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(again.error, expected, "{name}: the same after a restart");
        executor.shutdown().await.unwrap();
    }
}

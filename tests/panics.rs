//! A panic inside user code fails that procedure only; the engine and every other
//! procedure keep running.

mod common;

use common::{start, stores, Scripted, Step};
use proctor::ProcError;

#[actix::test]
async fn a_panic_in_execute_rolls_back_that_procedure_and_others_finish() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 2).await;
        let mut ids = Vec::new();
        for i in 0..5 {
            let plan = if i == 2 {
                vec![Step::More, Step::Panic("kaboom".into())]
            } else {
                vec![Step::More, Step::More]
            };
            ids.push(
                executor
                    .submit(Scripted::new(&format!("p{i}"), plan))
                    .await
                    .unwrap(),
            );
        }
        for (i, id) in ids.iter().enumerate() {
            let result = executor.wait(*id).await.unwrap();
            if i == 2 {
                let failure = result.unwrap_err();
                assert_eq!(
                    failure.error,
                    ProcError::Panicked {
                        hook: "execute".into(),
                        message: "kaboom".into()
                    },
                    "{store_name}"
                );
                assert_eq!(
                    failure.to_string(),
                    format!("procedure {id} (scripted) failed: panicked in execute: kaboom")
                );
            } else {
                assert_eq!(result, Ok(()), "p{i} on {store_name}");
            }
        }
        assert_eq!(rec.count("p2-rollback"), 2, "both executed steps roll back");
        // The engine still takes work after the panic.
        let id = executor
            .submit(Scripted::new("after", vec![]))
            .await
            .unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
    }
}

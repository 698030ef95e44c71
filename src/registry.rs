//! The registry of procedure types: a stable name for each Rust type, so that a
//! persisted state decodes back into the type that wrote it.
//!
//! The registry is the single source of truth for names: the engine looks a live
//! procedure's name up by its `TypeId` when it persists it, and a stored name back to a
//! decoder when it recovers it. An unregistered type or unknown name is an error that
//! names it, never a panic.

use std::any::TypeId;
use std::collections::{HashMap, HashSet};

use serde::de::DeserializeOwned;

use crate::erased::{erase, DynProc, ErasedProc};
use crate::fast_map::IdMap;
use crate::procedure::{type_id_of, ChildType, Procedure};
use crate::saga::{Saga, SagaProcedure};
use crate::state_machine::{StateMachine, StateMachineProcedure};

type Decoder<T> = fn(&[u8]) -> Result<T, rmp_serde::decode::Error>;
type DecodeFn<E> = Decoder<Box<dyn Procedure<E>>>;
type ErasedDecodeFn = Decoder<DynProc>;

/// Why a procedure could not be named, encoded or decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The Rust type was never registered.
    #[error("procedure type {rust_type} is not registered (call Registry::register)")]
    Unregistered {
        /// The Rust type name.
        rust_type: &'static str,
    },
    /// A stored state names a type this registry does not know.
    #[error("unknown procedure type {name:?}: no type is registered under that name")]
    UnknownName {
        /// The stored name.
        name: String,
    },
    /// The state could not be encoded.
    #[error("cannot encode procedure of type {name:?}: {source}")]
    Encode {
        /// The registered name.
        name: &'static str,
        /// The encoder's error.
        source: rmp_serde::encode::Error,
    },
    /// The stored bytes do not decode as the registered type.
    #[error("cannot decode procedure of type {name:?}: {source}")]
    Decode {
        /// The stored name.
        name: String,
        /// The decoder's error.
        source: rmp_serde::decode::Error,
    },
}

/// Procedure types by stable name, for an executor whose environment is `E` (see
/// [`Procedure`]; `()` by default).
///
/// ```
/// # use proctor::{async_trait, Context, Flow, ProcError, Procedure, Registry};
/// # use serde::{Deserialize, Serialize};
/// #[derive(Serialize, Deserialize)]
/// struct Noop;
/// # #[async_trait]
/// # impl Procedure for Noop {
/// #     async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
/// #     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
/// # }
/// let mut registry = Registry::new();
/// registry.register::<Noop>("noop");
/// let (name, bytes) = registry.encode(&Noop).unwrap();
/// assert_eq!(name, "noop");
/// assert!(registry.decode("noop", &bytes).is_ok());
/// assert!(registry.decode("create_table", &bytes).is_err());
/// ```
pub struct Registry<E = ()> {
    decoders: HashMap<&'static str, DecodeFn<E>>,
    types: Types,
}

/// What the engine needs of a registry, whatever its environment type: names by type,
/// and decoders to procedures it can run.
#[derive(Clone, Default)]
pub(crate) struct Types {
    names: IdMap<TypeId, &'static str>,
    decoders: HashMap<&'static str, ErasedDecodeFn>,
    /// Names registered with [`Registry::register_system`].
    system: HashSet<&'static str>,
    /// The child types each registered type declares ([`Procedure::child_types`]).
    children: Vec<(&'static str, ChildType)>,
}

impl<E> Clone for Registry<E> {
    fn clone(&self) -> Self {
        Registry {
            decoders: self.decoders.clone(),
            types: self.types.clone(),
        }
    }
}

impl<E> Default for Registry<E> {
    fn default() -> Self {
        Registry {
            decoders: HashMap::new(),
            types: Types::default(),
        }
    }
}

impl<E> std::fmt::Debug for Registry<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&str> = self.decoders.keys().copied().collect();
        names.sort_unstable();
        f.debug_struct("Registry").field("types", &names).finish()
    }
}

impl<E> Registry<E> {
    /// An empty registry. Its environment type is what its procedures take (the
    /// registry given to an executor whose [`env`](crate::ExecutorBuilder::env) is an
    /// `Arc<Cluster>` registers `Procedure<Cluster>`s): the compiler infers it from the
    /// `register` calls or the builder.
    ///
    /// ```
    /// # use proctor::{async_trait, Context, Flow, ProcError, Procedure, Registry};
    /// struct Cluster;
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct CreateTable;
    /// #[async_trait]
    /// impl Procedure<Cluster> for CreateTable {
    ///     async fn execute(&mut self, _: &mut Context<Cluster>) -> Result<Flow<Cluster>, ProcError> {
    ///         Ok(Flow::Done)
    ///     }
    ///     async fn rollback(&mut self, _: &mut Context<Cluster>) -> Result<(), ProcError> {
    ///         Ok(())
    ///     }
    /// }
    /// let mut registry = Registry::new(); // a Registry<Cluster>
    /// registry.register::<CreateTable>("create_table");
    /// ```
    pub fn new() -> Self {
        Self::default()
    }
}

impl<E: Send + Sync + 'static> Registry<E> {
    /// Registers `P` under `name`. The name is written into the store: never change it
    /// once procedures of this type may be persisted.
    ///
    /// # Panics
    /// If `name` or `P` is already registered: that is a programming error.
    pub fn register<P: Procedure<E> + DeserializeOwned>(
        &mut self,
        name: &'static str,
    ) -> &mut Self {
        fn decode<E: Send + Sync + 'static, P: Procedure<E> + DeserializeOwned>(
            bytes: &[u8],
        ) -> Result<Box<dyn Procedure<E>>, rmp_serde::decode::Error> {
            Ok(Box::new(rmp_serde::from_slice::<P>(bytes)?))
        }
        fn decode_erased<E: Send + Sync + 'static, P: Procedure<E> + DeserializeOwned>(
            bytes: &[u8],
        ) -> Result<DynProc, rmp_serde::decode::Error> {
            Ok(erase::<E, P>(rmp_serde::from_slice::<P>(bytes)?))
        }
        let old_name = self.types.names.insert(TypeId::of::<P>(), name);
        assert!(
            old_name.is_none(),
            "{} registered twice",
            std::any::type_name::<P>()
        );
        let old_decoder = self.decoders.insert(name, decode::<E, P>);
        assert!(
            old_decoder.is_none(),
            "procedure name {name:?} registered twice"
        );
        self.types.decoders.insert(name, decode_erased::<E, P>);
        for child in P::child_types() {
            self.types.children.push((name, child));
        }
        self
    }

    /// A child type some registered type declares ([`Procedure::child_types`]) that is
    /// not registered, as an error naming both; `None` when all are.
    pub(crate) fn missing_child_type(&self) -> Option<String> {
        self.types
            .children
            .iter()
            .find(|(_, child)| !self.types.names.contains_key(&child.type_id))
            .map(|(parent, child)| {
                format!(
                    "procedure type {parent:?} starts children of type {}, which is not \
                     registered: register it with Registry::register::<{}>(\"a name\")",
                    child.rust_type, child.rust_type
                )
            })
    }

    /// Registers the state machine `T` under `name`: the same as
    /// `register::<StateMachine<T, E>>(name)`, with `E` the registry's.
    ///
    /// ```
    /// # use proctor::{async_trait, Context, Flow, ProcError, Registry, StateContext, StateMachineProcedure};
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct CreateTable;
    /// # #[async_trait] impl StateMachineProcedure<Cluster> for CreateTable {
    /// #   type State = u8;
    /// #   fn initial_state(&self) -> u8 { 0 }
    /// #   async fn execute_from_state(&mut self, _: &mut StateContext<'_, u8, Cluster>, _: u8)
    /// #       -> Result<Flow<Cluster>, ProcError> { Ok(Flow::Done) }
    /// #   async fn rollback_state(&mut self, _: &mut Context<Cluster>, _: u8)
    /// #       -> Result<(), ProcError> { Ok(()) }
    /// # }
    /// struct Cluster;
    /// let mut registry = Registry::new();
    /// registry.register_state_machine::<CreateTable>("create_table");
    /// ```
    ///
    /// # Panics
    /// As [`register`](Self::register).
    pub fn register_state_machine<T: StateMachineProcedure<E>>(
        &mut self,
        name: &'static str,
    ) -> &mut Self {
        self.register::<StateMachine<T, E>>(name)
    }

    /// Registers the saga `S` under `name`: the same as
    /// `register::<Saga<S, E>>(name)`, with `E` the registry's.
    ///
    /// # Panics
    /// As [`register`](Self::register).
    pub fn register_saga<S: SagaProcedure<E>>(&mut self, name: &'static str) -> &mut Self {
        self.register::<Saga<S, E>>(name)
    }

    /// Registers `P` under `name` as a system procedure: its steps go before every
    /// queued step of other types, in arrival order, run on workers of their own
    /// ([`ExecutorBuilder::system_workers`](crate::ExecutorBuilder::system_workers), 1
    /// by default) or any other free one, the workers kept for young trees
    /// ([`ExecutorBuilder::reserved_workers`](crate::ExecutorBuilder::reserved_workers))
    /// included, as HBase runs the procedures of its meta table first, on urgent workers
    /// of their own. A step after a yield is queued like any other type's: a system
    /// procedure that yields until another one lets go of something does not keep the
    /// workers from it. For the few procedures
    /// that others wait on (assigning the catalog, fencing a dead node): a busy system
    /// type delays everything else.
    ///
    /// ```
    /// # use proctor::{async_trait, Context, Flow, ProcError, Procedure, Registry};
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct AssignMeta;
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct CreateTable;
    /// # #[async_trait] impl Procedure for AssignMeta {
    /// #     async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
    /// #     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
    /// # }
    /// # #[async_trait] impl Procedure for CreateTable {
    /// #     async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
    /// #     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
    /// # }
    /// let mut registry = Registry::new();
    /// registry
    ///     .register_system::<AssignMeta>("assign_meta")
    ///     .register::<CreateTable>("create_table");
    /// ```
    ///
    /// # Panics
    /// As [`register`](Self::register).
    pub fn register_system<P: Procedure<E> + DeserializeOwned>(
        &mut self,
        name: &'static str,
    ) -> &mut Self {
        self.register::<P>(name);
        self.types.system.insert(name);
        self
    }

    /// The registered name of a live procedure.
    ///
    /// # Errors
    /// [`RegistryError::Unregistered`] if its type was never registered.
    pub fn name_of(&self, proc: &dyn Procedure<E>) -> Result<&'static str, RegistryError> {
        self.types
            .name(type_id_of(proc))
            .ok_or(RegistryError::Unregistered {
                rust_type: proc.rust_type_name(),
            })
    }

    /// The registry's own copy of a name, if it is registered.
    pub fn static_name(&self, name: &str) -> Option<&'static str> {
        self.types.static_name(name)
    }

    /// The procedure's registered name and its encoded state.
    ///
    /// # Errors
    /// [`RegistryError::Unregistered`] for a type never registered,
    /// [`RegistryError::Encode`] if its state does not serialize.
    pub fn encode(
        &self,
        proc: &dyn Procedure<E>,
    ) -> Result<(&'static str, Vec<u8>), RegistryError> {
        let name = self.name_of(proc)?;
        let bytes = proc
            .encode_state()
            .map_err(|source| RegistryError::Encode { name, source })?;
        Ok((name, bytes))
    }

    /// Decodes a stored state written under `name`.
    ///
    /// # Errors
    /// [`RegistryError::UnknownName`] for a name never registered,
    /// [`RegistryError::Decode`] for bytes that are not a state of that type.
    pub fn decode(&self, name: &str, bytes: &[u8]) -> Result<Box<dyn Procedure<E>>, RegistryError> {
        decode_with(&self.decoders, name, bytes)
    }

    /// The engine's environment-free view.
    pub(crate) fn into_types(self) -> Types {
        self.types
    }
}

impl Types {
    /// The names registered as system procedures.
    pub(crate) fn system(&self) -> HashSet<&'static str> {
        self.system.clone()
    }

    fn name(&self, type_id: TypeId) -> Option<&'static str> {
        self.names.get(&type_id).copied()
    }

    /// The registry's own copy of a name, if it is registered.
    pub(crate) fn static_name(&self, name: &str) -> Option<&'static str> {
        self.decoders.get_key_value(name).map(|(k, _)| *k)
    }

    /// The registered name of a live procedure and its encoded state, encoded in the
    /// thread's buffer ([`with_scratch`]) and copied out at its size: one allocation
    /// rather than a growing `Vec`'s several (four for a 50-byte state).
    pub(crate) fn encode(
        &self,
        proc: &dyn ErasedProc,
    ) -> Result<(&'static str, Vec<u8>), RegistryError> {
        with_scratch(|buf| Ok((self.encode_into(proc, buf)?, buf.to_vec())))
    }

    /// [`Types::encode`], the state appended to `out` (a buffer the caller reuses).
    pub(crate) fn encode_into(
        &self,
        proc: &dyn ErasedProc,
        out: &mut Vec<u8>,
    ) -> Result<&'static str, RegistryError> {
        let name = self
            .name(proc.proc_type_id())
            .ok_or_else(|| RegistryError::Unregistered {
                rust_type: proc.rust_type_name(),
            })?;
        proc.encode_state_into(out)
            .map_err(|source| RegistryError::Encode { name, source })?;
        Ok(name)
    }

    /// Decodes a stored state written under `name`.
    pub(crate) fn decode(&self, name: &str, bytes: &[u8]) -> Result<DynProc, RegistryError> {
        decode_with(&self.decoders, name, bytes)
    }
}

/// Runs `f` with the thread's encoding buffer, empty: states are encoded there and
/// copied out at their size, so an encoding costs one allocation of the exact size
/// rather than a growing `Vec`'s several. A buffer grown past 1 MiB (one huge state)
/// is not kept for the thread's life.
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    const KEEP: usize = 1 << 20;
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with_borrow_mut(|buf| {
        buf.clear();
        let result = f(buf);
        if buf.capacity() > KEEP {
            *buf = Vec::new();
        }
        result
    })
}

/// Decodes `bytes` with the decoder registered under `name`.
fn decode_with<T>(
    decoders: &HashMap<&'static str, Decoder<T>>,
    name: &str,
    bytes: &[u8],
) -> Result<T, RegistryError> {
    let decode = decoders
        .get(name)
        .ok_or_else(|| RegistryError::UnknownName { name: name.into() })?;
    decode(bytes).map_err(|source| RegistryError::Decode {
        name: name.into(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procedure::{Context, Flow, ProcError};
    use async_trait::async_trait;
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct A {
        n: u32,
    }
    #[derive(Serialize, Deserialize)]
    struct B;

    #[async_trait]
    impl Procedure for A {
        async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> {
            Ok(Flow::Done)
        }
        async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
            Ok(())
        }
    }
    #[async_trait]
    impl Procedure for B {
        async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> {
            Ok(Flow::Done)
        }
        async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
            Ok(())
        }
    }

    fn registry() -> Registry {
        let mut r = Registry::new();
        r.register::<A>("a");
        r
    }

    #[test]
    fn encode_and_decode() {
        let r = registry();
        let (name, bytes) = r.encode(&A { n: 7 }).unwrap();
        assert_eq!(name, "a");
        let back = r.decode(name, &bytes).unwrap();
        let any: &dyn std::any::Any = &*back;
        assert_eq!(any.downcast_ref::<A>(), Some(&A { n: 7 }));
    }

    #[test]
    fn errors_name_the_type() {
        let r = registry();
        let cases: [(Result<(), RegistryError>, &str); 3] = [
            (
                r.encode(&B).map(|_| ()),
                "procedure type proctor::registry::tests::B is not registered",
            ),
            (
                r.decode("b", &[]).map(|_| ()),
                "unknown procedure type \"b\"",
            ),
            (
                r.decode("a", &[0xc1]).map(|_| ()),
                "cannot decode procedure of type \"a\"",
            ),
        ];
        for (result, text) in cases {
            let err = result.unwrap_err().to_string();
            assert!(err.starts_with(text), "{err}");
        }
    }

    #[test]
    #[should_panic(expected = "registered twice")]
    fn a_name_is_registered_once() {
        let mut r = registry();
        r.register::<B>("a");
    }
}

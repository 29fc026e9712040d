//! A connection for a writer thread: the async client of `tokio-postgres`,
//! driven by a runtime of the connection's own.
//!
//! The blocking `postgres` client sends one request and waits for its
//! answer before the next can go. A writer knows some requests in advance:
//! the `BEGIN` and the read that locks the group's records, the group's
//! writes and its `COMMIT`. [`Session::pipeline`] sends such a pair in one
//! flush, and the server answers both in one round trip, which on a busy
//! machine costs more than the statements themselves.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Config, Error, Row, SimpleQueryMessage, Socket, Statement, ToStatement};

use crate::error::{ErrorKind, LedgerError};

/// One connection and the runtime that drives it. Each call blocks the
/// calling thread (never a runtime's) until its answer is in.
pub(super) struct Session {
    /// Taken only when the session is dropped.
    client: Option<Client>,
    /// The connection's task, until the session is dropped.
    connection: Option<tokio::task::JoinHandle<()>>,
    /// Runs the connection's task while a call waits, and only then.
    runtime: tokio::runtime::Runtime,
}

/// How long a dropped session waits for its connection to say goodbye.
const GOODBYE: Duration = Duration::from_millis(100);

impl Session {
    /// Connects with `config` over `tls`.
    pub(super) fn connect<T>(config: &Config, tls: T) -> Result<Result<Self, Error>, LedgerError>
    where
        T: MakeTlsConnect<Socket> + 'static + Send,
        T::TlsConnect: Send,
        T::Stream: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|err| {
                LedgerError::caused(
                    ErrorKind::Storage,
                    "cannot start a PostgreSQL connection's runtime",
                    err,
                )
            })?;
        Ok(match runtime.block_on(config.connect(tls)) {
            Ok((client, connection)) => {
                let connection = runtime.spawn(async move {
                    if let Err(err) = connection.await {
                        tracing::debug!(error = %err, "a PostgreSQL writer connection ended");
                    }
                });
                Ok(Self {
                    client: Some(client),
                    connection: Some(connection),
                    runtime,
                })
            }
            Err(err) => Err(err),
        })
    }

    fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    fn client(&self) -> &Client {
        self.client
            .as_ref()
            .expect("a session has its client until dropped")
    }

    /// Whether the connection is gone.
    pub(super) fn is_closed(&self) -> bool {
        self.client().is_closed()
    }

    pub(super) fn prepare(&self, sql: &str) -> Result<Statement, Error> {
        self.block_on(self.client().prepare(sql))
    }

    pub(super) fn query<T>(&self, statement: &T, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, Error>
    where
        T: ?Sized + ToStatement,
    {
        self.block_on(self.client().query(statement, params))
    }

    pub(super) fn query_one<T>(&self, statement: &T, params: &[&(dyn ToSql + Sync)]) -> Result<Row, Error>
    where
        T: ?Sized + ToStatement,
    {
        self.block_on(self.client().query_one(statement, params))
    }

    pub(super) fn execute<T>(&self, statement: &T, params: &[&(dyn ToSql + Sync)]) -> Result<u64, Error>
    where
        T: ?Sized + ToStatement,
    {
        self.block_on(self.client().execute(statement, params))
    }

    pub(super) fn batch_execute(&self, sql: &str) -> Result<(), Error> {
        self.block_on(self.client().batch_execute(sql))
    }

    pub(super) fn simple_query(&self, sql: &str) -> Result<Vec<SimpleQueryMessage>, Error> {
        self.block_on(self.client().simple_query(sql))
    }

    /// Sends `first` (simple statements) and then `statement` in one flush,
    /// and waits for both answers. The server runs them in that order;
    /// `statement` runs even when `first` failed, so it must be harmless
    /// then (a read, or a statement of a transaction `first` aborted).
    pub(super) fn pipeline(
        &self,
        first: &str,
        statement: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> (Result<Vec<SimpleQueryMessage>, Error>, Result<Vec<Row>, Error>) {
        self.block_on(in_order(
            self.client().simple_query(first),
            self.client().query(statement, params),
        ))
    }

    /// Sends `before` (a statement and its parameters, if any),
    /// `statement`, and then `then` (simple statements, if any) in one
    /// flush, and waits for every answer. Each runs even when one before it
    /// failed.
    pub(super) fn pipeline_then(
        &self,
        before: Option<(&Statement, &[&(dyn ToSql + Sync)])>,
        statement: &Statement,
        params: &[&(dyn ToSql + Sync)],
        then: Option<&str>,
    ) -> Piped {
        let before = async {
            match before {
                Some((statement, params)) => self.client().execute(statement, params).await.map(drop),
                None => Ok(()),
            }
        };
        let then = async {
            match then {
                Some(then) => Some(self.client().simple_query(then).await),
                None => None,
            }
        };
        let ((before, rows), then) = self.block_on(in_order(
            in_order(before, self.client().query(statement, params)),
            then,
        ));
        (before, rows, then)
    }
}

/// The answers of [`Session::pipeline_then`], in the order sent.
pub(super) type Piped = (
    Result<(), Error>,
    Result<Vec<Row>, Error>,
    Option<Result<Vec<SimpleQueryMessage>, Error>>,
);

impl Drop for Session {
    fn drop(&mut self) {
        // With its client gone, the connection sends the server a goodbye
        // and ends, if it is given the chance (not from inside a runtime,
        // where blocking is not allowed).
        drop(self.client.take());
        if let Some(connection) = self.connection.take() {
            if tokio::runtime::Handle::try_current().is_err() {
                // The timer is made inside the runtime, which drives it.
                let _ = self
                    .runtime
                    .block_on(async { tokio::time::timeout(GOODBYE, connection).await });
            }
        }
    }
}

/// Both futures' outputs, `first` always polled before `second`:
/// `tokio-postgres` documents that requests run in the order their futures
/// are first polled, so the requests leave and run in this order.
async fn in_order<A: Future, B: Future>(first: A, second: B) -> (A::Output, B::Output) {
    let (mut first, mut second) = (pin!(first), pin!(second));
    let (mut a, mut b) = (None, None);
    poll_fn(|cx| {
        if a.is_none() {
            if let Poll::Ready(output) = first.as_mut().poll(cx) {
                a = Some(output);
            }
        }
        if b.is_none() {
            if let Poll::Ready(output) = second.as_mut().poll(cx) {
                b = Some(output);
            }
        }
        match (a.take(), b.take()) {
            (Some(a), Some(b)) => Poll::Ready((a, b)),
            (left, right) => {
                (a, b) = (left, right);
                Poll::Pending
            }
        }
    })
    .await
}

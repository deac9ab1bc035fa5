//! SDK errors mapped to idem's [`Error`] variants.

use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use idem_core::{BoxError, Error};

use crate::config::ITEM_LIMIT_BYTES;
use crate::item::Item;

/// What a failed conditional write says.
pub(crate) enum WriteError {
    /// The condition did not hold; the item as it was, when DynamoDB returned it.
    Condition(Option<Item>),
    /// Anything else, already mapped.
    Other(Error),
}

/// The operation errors that carry a `ConditionalCheckFailedException`.
pub(crate) trait ConditionFailed: Sized {
    /// The item the failed condition saw, or `self` if this is another error.
    fn condition_item(self) -> Result<Option<Item>, Self>;
}

macro_rules! condition_failed {
    ($($error:ident),*) => {$(
        impl ConditionFailed for $error {
            fn condition_item(self) -> Result<Option<Item>, Self> {
                match self {
                    $error::ConditionalCheckFailedException(e) => Ok(e.item),
                    other => Err(other),
                }
            }
        }
    )*};
}

condition_failed!(PutItemError, UpdateItemError, DeleteItemError);

/// Maps a failed conditional write of an item of about `size` bytes.
pub(crate) fn write_error<E>(
    what: &'static str,
    size: usize,
    err: SdkError<E, HttpResponse>,
) -> WriteError
where
    E: ConditionFailed + ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match err {
        SdkError::ServiceError(service) => match service.into_err().condition_item() {
            Ok(item) => WriteError::Condition(item),
            Err(e) => WriteError::Other(service_error(what, size, e)),
        },
        other => WriteError::Other(sdk_error(what, size, other)),
    }
}

/// Maps any failed call writing an item of about `size` bytes (0 for reads).
pub(crate) fn sdk_error<E>(what: &'static str, size: usize, err: SdkError<E, HttpResponse>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match err {
        SdkError::ServiceError(service) => service_error(what, size, service.into_err()),
        SdkError::ConstructionFailure(_) => Error::Config {
            message: format!("DynamoDB {what}: {}", DisplayErrorContext(&err)),
            source: Some(Box::new(err)),
        },
        // Timeouts, refused or dropped connections, unparsable answers.
        other => {
            let message = format!("DynamoDB {what}: {}", DisplayErrorContext(&other));
            Error::unavailable(message, other)
        }
    }
}

/// How a caller should take an error answer from DynamoDB.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Transient: throttling, capacity, server errors, conflicts. Retry later.
    Retry,
    /// The table, the credentials or the request do not fit: fix the configuration.
    Config,
    /// The item would exceed DynamoDB's 400 KB limit.
    TooLarge,
}

/// Classifies an error answer by its code and message.
pub(crate) fn classify(code: &str, message: &str) -> Kind {
    match code {
        "ResourceNotFoundException"
        | "AccessDeniedException"
        | "UnrecognizedClientException"
        | "InvalidSignatureException"
        | "IncompleteSignatureException"
        | "MissingAuthenticationToken"
        | "MissingAuthenticationTokenException"
        | "InvalidClientTokenId"
        | "SerializationException" => Kind::Config,
        "ValidationException" => {
            let m = message.to_ascii_lowercase();
            if m.contains("size") && m.contains("exceeded") {
                Kind::TooLarge
            } else {
                Kind::Config
            }
        }
        // ProvisionedThroughputExceededException, ThrottlingException, RequestLimitExceeded,
        // InternalServerError, ServiceUnavailable, TransactionConflictException, expired
        // session tokens (the provider refreshes them) and anything unknown: fail closed,
        // retryable.
        _ => Kind::Retry,
    }
}

fn service_error<E>(what: &'static str, size: usize, err: E) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let code = err.code().unwrap_or("unknown").to_owned();
    let text = err.message().unwrap_or("").to_owned();
    let message = format!("DynamoDB {what}: {code}: {text}");
    match classify(&code, &text) {
        Kind::Retry => Error::unavailable(message, err),
        Kind::Config => Error::Config {
            message,
            source: Some(BoxError::from(err)),
        },
        Kind::TooLarge => Error::TooLarge {
            what: "item",
            size,
            limit: ITEM_LIMIT_BYTES,
        },
    }
}

#[cfg(test)]
mod tests {
    use aws_sdk_dynamodb::error::ErrorMetadata;
    use aws_sdk_dynamodb::types::error::ProvisionedThroughputExceededException;

    use super::*;

    #[test]
    fn provisioned_throughput_exceeded_is_unavailable() {
        let meta = ErrorMetadata::builder()
            .code("ProvisionedThroughputExceededException")
            .message("The level of configured provisioned throughput for the table was exceeded")
            .build();
        let throttled = PutItemError::ProvisionedThroughputExceededException(
            ProvisionedThroughputExceededException::builder()
                .message("exceeded")
                .meta(meta)
                .build(),
        );
        let err = service_error("claim", 0, throttled);
        assert!(err.is_retryable(), "{err:?}");
        assert!(
            err.to_string()
                .contains("ProvisionedThroughputExceededException"),
            "{err}"
        );
    }

    #[test]
    fn throttling_and_server_errors_are_retryable() {
        for code in [
            "ProvisionedThroughputExceededException",
            "ThrottlingException",
            "RequestLimitExceeded",
            "InternalServerError",
            "ServiceUnavailable",
            "TransactionConflictException",
            "ExpiredTokenException",
            "SomethingNew",
        ] {
            assert_eq!(classify(code, "slow down"), Kind::Retry, "{code}");
        }
    }

    #[test]
    fn configuration_and_size_errors_are_told_apart() {
        assert_eq!(
            classify("ResourceNotFoundException", "Requested resource not found"),
            Kind::Config
        );
        assert_eq!(classify("UnrecognizedClientException", ""), Kind::Config);
        assert_eq!(
            classify(
                "ValidationException",
                "Item size has exceeded the maximum allowed size"
            ),
            Kind::TooLarge
        );
        assert_eq!(
            classify(
                "ValidationException",
                "Item size to update has exceeded the maximum allowed size"
            ),
            Kind::TooLarge
        );
        assert_eq!(
            classify(
                "ValidationException",
                "The provided key element does not match the schema"
            ),
            Kind::Config
        );
    }
}

//! Publishes "order created" messages for the example consumer: `publisher [COUNT]
//! [FIRST]` sends orders FIRST..FIRST+COUNT (default 1000 orders from 1) to
//! `ORDERS_QUEUE` on `AMQP_ADDR`, persistent, with publisher confirms. Each message's
//! `message_id` is its order id: the key the consumer deduplicates on.
//!
//! `DUPLICATE_EVERY=K` publishes every K-th order twice in a row, as a producer whose
//! first publish timed out and that retried: the consumer must deduct it once.

use std::error::Error;
use std::process::ExitCode;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};

use idemstore_rabbitmq_example::{Order, amqp_addr, declare_queues, order_id, queue_name};

/// AMQP delivery mode 2: the broker writes the message to disk.
const PERSISTENT: u8 = 2;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("publisher: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let count: u64 = args.next().map_or(Ok(1000), |a| a.parse())?;
    let first: u64 = args.next().map_or(Ok(1), |a| a.parse())?;
    let queue = queue_name();
    let duplicate_every: u64 = match std::env::var("DUPLICATE_EVERY") {
        Ok(k) => k
            .parse()
            .map_err(|_| format!("DUPLICATE_EVERY={k:?} is not a number"))?,
        Err(_) => 0,
    };

    let connection = Connection::connect(&amqp_addr(), ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    declare_queues(&channel, &queue).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut confirms = Vec::with_capacity(count as usize);
    let mut published = 0u64;
    let copies = |n: u64| {
        if duplicate_every > 0 && n.is_multiple_of(duplicate_every) {
            2
        } else {
            1
        }
    };
    for n in (first..first + count).flat_map(|n| std::iter::repeat_n(n, copies(n))) {
        published += 1;
        let properties = BasicProperties::default()
            .with_message_id(order_id(n).into())
            .with_delivery_mode(PERSISTENT);
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &Order::for_number(n).to_body(),
                properties,
            )
            .await?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        match confirm.await? {
            Confirmation::Ack(_) => {}
            other => return Err(format!("the broker did not take a message: {other:?}").into()),
        }
    }
    connection.close(200, "published".into()).await?;
    println!("published {count} orders in {published} messages to {queue}");
    Ok(())
}

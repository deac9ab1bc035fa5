//! A producer that writes the Kafka protocol by hand, for records no client library will
//! build: a header whose name is not UTF-8, say (rdkafka takes header names as `&str`).
//! One `Produce` (version 3) of one record batch (magic 2) to a one-broker cluster; or of
//! a batch no client would write, whose compressed records do not decode.

use std::io::{Read, Write};
use std::net::TcpStream;

/// One record: key, value and headers as raw bytes.
pub struct RawRecord<'a> {
    pub key: Option<&'a [u8]>,
    pub value: &'a [u8],
    pub headers: &'a [(&'a [u8], &'a [u8])],
}

/// Writes `records` to `topic`/`partition` on the broker at `broker` (which must lead the
/// partition) and returns the base offset the broker assigned, or its error code.
pub fn produce_raw(
    broker: &str,
    topic: &str,
    partition: i32,
    records: &[RawRecord<'_>],
) -> Result<i64, i16> {
    send_batch(broker, topic, partition, &record_batch(records))
}

/// Writes one batch whose records do not decode, as a corrupt batch, or one compressed with
/// a codec the consumer lacks, reaches it: its attributes name `codec` (1 is gzip; 5 to 7
/// name none) but its records are not compressed with anything. Returns its offset or the
/// broker's error.
pub fn produce_undecodable(
    broker: &str,
    topic: &str,
    partition: i32,
    codec: i16,
) -> Result<i64, i16> {
    let records = b"these bytes are compressed with no codec";
    send_batch(broker, topic, partition, &batch(codec, 1, records))
}

/// One `Produce` of `batch` to `topic`/`partition`: its base offset or the error code.
fn send_batch(broker: &str, topic: &str, partition: i32, batch: &[u8]) -> Result<i64, i16> {
    let mut body = Vec::new();
    put_i16(&mut body, 0); // api key: Produce
    put_i16(&mut body, 3); // api version
    put_i32(&mut body, 1); // correlation id
    put_str(&mut body, b"idem-test-wire");
    put_i16(&mut body, -1); // transactional id: none
    put_i16(&mut body, -1); // acks: all
    put_i32(&mut body, 10_000);
    put_i32(&mut body, 1); // one topic
    put_str(&mut body, topic.as_bytes());
    put_i32(&mut body, 1); // one partition
    put_i32(&mut body, partition);
    put_i32(&mut body, len_i32(batch.len()));
    body.extend_from_slice(batch);

    let mut conn = TcpStream::connect(broker).expect("connect to the broker");
    let mut frame = Vec::with_capacity(body.len() + 4);
    put_i32(&mut frame, len_i32(body.len()));
    frame.extend_from_slice(&body);
    conn.write_all(&frame).expect("send Produce");
    let mut size = [0u8; 4];
    conn.read_exact(&mut size).expect("read the response size");
    let mut reply = vec![0u8; usize::try_from(i32::from_be_bytes(size)).expect("size")];
    conn.read_exact(&mut reply).expect("read the response");

    // correlation id, one topic (name), one partition: index, error code, base offset.
    let mut at = 4 + 4;
    let name_len = usize::try_from(i16::from_be_bytes([reply[at], reply[at + 1]])).expect("name");
    at += 2 + name_len + 4 + 4;
    let error = i16::from_be_bytes([reply[at], reply[at + 1]]);
    let offset = i64::from_be_bytes(reply[at + 2..at + 10].try_into().expect("offset"));
    if error == 0 { Ok(offset) } else { Err(error) }
}

fn record_batch(records: &[RawRecord<'_>]) -> Vec<u8> {
    let mut body = Vec::new();
    for (delta, r) in records.iter().enumerate() {
        let mut rec = Vec::new();
        rec.push(0); // attributes
        put_varint(&mut rec, 0); // timestamp delta
        put_varint(&mut rec, i64::try_from(delta).expect("delta"));
        put_bytes_varint(&mut rec, r.key);
        put_bytes_varint(&mut rec, Some(r.value));
        put_varint(&mut rec, i64::try_from(r.headers.len()).expect("headers"));
        for (name, value) in r.headers {
            put_bytes_varint(&mut rec, Some(name));
            put_bytes_varint(&mut rec, Some(value));
        }
        put_varint(&mut body, i64::try_from(rec.len()).expect("record"));
        body.extend_from_slice(&rec);
    }
    // No compression, not transactional.
    batch(0, records.len(), &body)
}

/// A record batch (magic 2) of `count` records whose encoded form is `records`, with
/// `attributes` (the low three bits name the codec `records` is compressed with).
fn batch(attributes: i16, count: usize, records: &[u8]) -> Vec<u8> {
    // From attributes to the end: what the CRC covers.
    let mut tail = Vec::new();
    put_i16(&mut tail, attributes);
    put_i32(&mut tail, len_i32(count) - 1); // last offset delta
    put_i64(&mut tail, 0); // base timestamp
    put_i64(&mut tail, 0); // max timestamp
    put_i64(&mut tail, -1); // producer id
    put_i16(&mut tail, -1); // producer epoch
    put_i32(&mut tail, -1); // base sequence
    put_i32(&mut tail, len_i32(count));
    tail.extend_from_slice(records);
    let crc = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI).checksum(&tail);

    let mut batch = Vec::with_capacity(tail.len() + 21);
    put_i64(&mut batch, 0); // base offset
    put_i32(&mut batch, len_i32(4 + 1 + 4 + tail.len())); // batch length
    put_i32(&mut batch, -1); // partition leader epoch
    batch.push(2); // magic
    batch.extend_from_slice(&crc.to_be_bytes());
    batch.extend_from_slice(&tail);
    batch
}

fn len_i32(n: usize) -> i32 {
    i32::try_from(n).expect("length fits an i32")
}

fn put_i16(b: &mut Vec<u8>, v: i16) {
    b.extend_from_slice(&v.to_be_bytes());
}

fn put_i32(b: &mut Vec<u8>, v: i32) {
    b.extend_from_slice(&v.to_be_bytes());
}

fn put_i64(b: &mut Vec<u8>, v: i64) {
    b.extend_from_slice(&v.to_be_bytes());
}

fn put_str(b: &mut Vec<u8>, s: &[u8]) {
    put_i16(b, i16::try_from(s.len()).expect("short string"));
    b.extend_from_slice(s);
}

/// A zigzag varint, as record fields are written.
fn put_varint(b: &mut Vec<u8>, v: i64) {
    let mut z = ((v << 1) ^ (v >> 63)) as u64;
    while z >= 0x80 {
        b.push((z as u8) | 0x80);
        z >>= 7;
    }
    b.push(z as u8);
}

fn put_bytes_varint(b: &mut Vec<u8>, s: Option<&[u8]>) {
    match s {
        None => put_varint(b, -1),
        Some(s) => {
            put_varint(b, i64::try_from(s.len()).expect("length"));
            b.extend_from_slice(s);
        }
    }
}
